"""``signvote``: signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar,
"signSGD with Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019).

The paper's Algorithm 1 (with momentum ``beta = 0``, plain signSGD): every worker sends the sign
of its gradient, one bit per entry; the server sends back the sign of their sum, the majority
vote; every worker steps ``x -= eta * sign(sum_m sign(g_m))``. In federated rounds a client's
gradient is its pseudo-gradient ``global - local``; clients keep nothing between rounds (no
residual, no momentum); the server counts every client once (``weighted = False``: a vote, not
a mean by examples) and steps by ``server_lr`` times the vote, each entry moving by exactly
``server_lr`` or not at all (a tie). ``server_lr`` is this method's own default, set on the
tasks fedgc ships (docs/methods.md). An entry of the pseudo-gradient that is exactly 0 (an
input pixel no client's data lights) is sent with a coin-flip sign: with one fixed sign every
client would vote for it every round and the server would move it by ``server_lr`` each round
for nothing.

A vote travels as the ``signs`` payload (``fedgc.methods.efsign``, docs/wire.md section 14)
with scale 1; the server refuses any other scale, so that no client weighs its vote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dgc import Compressor, DGCConfig, StateError
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import Aggregator, Method
from fedgc.methods.compressors import StatelessCompressor
from fedgc.methods.efsign import (
    SIGNS_PHONE_CONFIG,
    SignsCodec,
    SignsPayload,
    SignsUpdate,
    dense_signs,
)
from fedgc.methods.payloads import Bound, Codec, PayloadError
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register

__all__ = ["MajorityVote", "SignVote", "VoteCodec", "VoteCompressor", "vote_seed"]

#: The server's step per round and entry on fedgc's tasks (docs/methods.md, "signSGD with
#: majority vote": tuned on mnist5k, seed 0, 50 rounds).
SERVER_LR = 0.003


class VoteCompressor(StatelessCompressor):
    """The sign of each entry of the pseudo-gradient, a coin flip for an exact 0 (implements
    :class:`dgc.base.Compressor`; it keeps no state: a vote that was not counted is lost, as in
    the paper).

    Parameters
    ----------
    seed : int
        This client's seed; round ``r`` flips its coins with ``numpy.random.default_rng([seed,
        r])``.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SignsUpdate:
        """The signs of ``grads``, scale 1."""
        for name, g in grads.items():
            if not torch.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf")
        sequence = 0 if sequence is None else int(sequence)
        rng = np.random.default_rng([self.seed, sequence])
        out = SignsUpdate({}, sequence)
        for name, g in grads.items():
            flat = g.detach().reshape(-1).cpu()  # the coins and the bits are the host's
            coin = torch.from_numpy(rng.random(flat.numel()) < 0.5)
            negative = torch.where(flat == 0, coin, flat < 0)
            out.tensors[name], out.scales[name] = dense_signs(tuple(g.shape), negative, 1.0), 1.0
        return out


class VoteCodec(SignsCodec):
    """The ``signs`` payload, every scale 1: a vote, that no client may weigh."""

    def check(self, payload: SignsPayload, bound: Bound) -> None:  # type: ignore[override]
        super().check(payload, bound)
        for name, scale in payload.scales.items():
            if scale != 1.0:
                raise PayloadError(f"tensor {name!r} carries scale {scale!r}; a vote's signs "
                                   f"have scale 1")


class MajorityVote(Aggregator):
    """The sign of the round's unweighted sum of signs (ties: 0, the entry stays)."""

    weighted = False

    def finish(self, combined: Mapping[str, torch.Tensor],
               shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, torch.Tensor]:
        return {name: torch.sign(t) for name, t in combined.items()}


class SignVote(PhoneExport, Method):
    """signSGD with majority vote, stateless clients (module docstring)."""

    name = "signvote"
    label = "signSGD-MV"
    order = 52
    compared = False  # a catalogue method: compare --methods ...,signvote
    family = "signs"
    description = ("the sign of every entry of the pseudo-gradient, one bit each; the server "
                   "steps by `server_lr` times the sign of the unweighted sum (majority vote)")
    defaults = {"server_lr": SERVER_LR}

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        return VoteCompressor(vote_seed(train, client_key))

    def codec(self, train: TrainSettings) -> Codec:
        return VoteCodec()

    def aggregator(self, run: RunSettings) -> Aggregator:
        return MajorityVote()

    def uplink_density(self, train: TrainSettings) -> float:
        return 1.0  # one bit for every entry

    # -- phones: the vote on the host (android_bridge.host_encoders), no program
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        return SIGNS_PHONE_CONFIG

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        """The vote's host encoder, the ``signs`` payload and the client's seed (its coins)."""
        return {"encoder": self.name, "payload": SignsCodec.kind,
                "seed": vote_seed(train, client_key)}

    def phone_codec(self) -> Codec:
        return VoteCodec()


def vote_seed(train: TrainSettings, client_key: int) -> int:
    """A client's seed for its coins: one per client and run."""
    return (int(train.seed) << 32) + int(client_key)


register(SignVote())
