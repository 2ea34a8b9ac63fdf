"""The shared-index sign channel: every client of a round sends its residual at one index set.

Top-k selection alone is a poor fit for federated rounds with label skew and partial
participation (``docs/federated_momentum.md``): each client sends its own largest residual
entries, mostly directions peculiar to its data, and an entry that a single client sends is
averaged with nine zeros. Dense FedAvg gets its accuracy from the opposite: every coordinate is
averaged over every client of the round, so client drift cancels.

This channel adds that consensus at about one bit per entry. Each round the server picks one
index set per sparsified tensor, the coordinates where an exponential moving average of its past
aggregates is largest (:mod:`dgc.signs.planner`), and sends it with the model
(:mod:`dgc.signs.codec`, Golomb-Rice coded). Every client sends its residual at those indices as
scaled signs (:mod:`dgc.signs.client`), one fp32 scale per tensor and one bit per entry; what the
signs do not carry stays in the residual. The server scatters the signs at the indices it sent
and aggregates them with the top-k updates.

The indices never travel uplink, so a shared entry costs 1 bit against ~27.5 for a top-k entry
(Golomb index + fp16 value) at density 0.001.
"""

from dgc.signs.client import take_signs, take_values
from dgc.signs.codec import (
    Masks,
    decode_mask,
    decode_shared,
    decode_signs,
    encode_mask,
    encode_signs,
    encode_values,
)
from dgc.signs.planner import SharedIndexPlanner

__all__ = ["Masks", "SharedIndexPlanner", "decode_mask", "decode_shared", "decode_signs",
           "encode_mask", "encode_signs", "encode_values", "take_signs", "take_values"]
