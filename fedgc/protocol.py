"""The message contract between DGCStrategy, the ClientApp and the phone bridge.

Record keys, the reply metrics and their one builder, record <-> bytes, the run config's
digest, and patch application. A train message carries

- ``config`` (ConfigRecord): the per-node keys below, among them ``config_digest``, the digest
  of the run's config (:func:`config_digest`);
- ``run_config`` (ConfigRecord), only when the server does not know the client to hold that
  config (its first contact, a config that changed, a client that said it lost it): the
  :class:`fedgc.settings.TrainSettings` keys and the method's. The client keeps it in its
  context's state (:data:`RUN_CONFIG`) and reads every later message's ``config`` over it; a
  client that holds no config of that digest fails the round with :data:`CONFIG_MISSING` in
  its error, and the server sends the config whole next time. A ``config`` without
  ``config_digest`` holds every key itself (evaluate messages, older servers);
- ``arrays`` (ArrayRecord): either the dense global model (one numpy Array per tensor, what
  Flower's FedAvg sends), or one byte Array named ``patch``: a ``dgc.encode``-d update whose
  fp32 values *replace* the entries of the model version the client already holds
  (``base_version``, or any of ``base_versions``: the server may not know which of them the
  client holds, and the patch carries every entry that differs in any of them). Replacing
  instead of adding keeps the client's copy bit-identical to the server's. The exception is a
  patch on one base version with ``patch_add``: for the tensors it names the values are
  differences to *add* (int8-grid broadcasts, where the server checked that the sums are exact).
  With ``patch_context`` (``downlink_context``), the tensors it names travel as segments
  ``NAME#j`` of their entries ranked by displacement from version 0 (:mod:`fedgc.context_patch`).

A DGC train message may also carry ``shared`` (ArrayRecord with one byte Array
``shared_mask``: the round's shared index sets, ``dgc.signs.codec.encode_mask``). The client then
sends its residual at those indices as scaled signs.

A train reply carries ``update`` (ArrayRecord with one byte Array: the ``dgc.encode``-d
pseudo-gradient), for a message with index sets ``shared`` (one byte Array ``shared_signs``:
``dgc.signs.codec.encode_signs``), and ``metrics`` (MetricRecord, keys in
:data:`REPLY_METRICS`, built by :func:`reply_metrics`): only what the server reads (the rest
of what a client knows of its update, its size, nonzeros and sequence, the server reads from
the update itself).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

# A patch's keys and how a client applies it, kept where phones import them without Flower.
from fedgc.patching import PATCH_ADD as PATCH_ADD
from fedgc.patching import PATCH_CONTEXT as PATCH_CONTEXT
from fedgc.patching import ProtocolError as ProtocolError
from fedgc.patching import apply_patch as apply_patch

#: stype of a byte Array that holds ``dgc.encode`` output.
WIRE_STYPE = "fedgc.dgc.wire"

# Record keys.
ARRAYS = "arrays"
CONFIG = "config"
RUN_CONFIG = "run_config"  # the run's config, sent whole only when needed; the context's copy
UPDATE = "update"
METRICS = "metrics"
PATCH = "patch"
SHARED = "shared"  # ArrayRecord of the shared-index channel (dgc.signs), both directions
SHARED_MASK = "shared_mask"  # its byte Array in a train message
SHARED_SIGNS = "shared_signs"  # its byte Array in a train reply
NODE = "node"  # ConfigRecord of a reply from a Ray worker: ray_node, host (client.node)
SECAGG = "secagg"  # byte Array of a secure-aggregation stage (fedgc.privacy.secagg.wire), both ways
#: The query action of the secure-aggregation stages a train message does not carry
#: (message type ``query.secagg``: setup, share keys, unmask; client/secure.py).
SECAGG_ACTION = "secagg"
#: The reply metric of a masked vector's coordinates the fixed point clamped.
SECAGG_SATURATED = "secagg_saturated"
#: Adaptive clipping (``privacy.clip_quantile``): the round's clip in a train message's config,
#: and a client's bit (1: its update's norm was within it) in its reply metrics, or, under
#: secure aggregation, as the masked vector's last coordinate (times the fixed point's range).
DP_CLIP = "dp_clip"
DP_CLIP_BIT = "dp_clip_bit"

# Per-node config keys the server adds to the TrainSettings keys.
SERVER_ROUND = "server-round"
ACK_SEQUENCE = "ack_sequence"  # sequence of this client's last update that was aggregated; -1 none
MODEL_VERSION = "model_version"  # version of the model in this message
#: Set (True) in an asynchronous dispatch: the age of an update the server never aggregated is
#: counted in model versions (applied steps: this message's version less the one the update
#: trained on), not in sequences, of which the asynchronous loop uses one per dispatch (about
#: ``async.buffer`` per applied step). Absent: in sequences, a synchronous run's rounds.
AGE_IN_VERSIONS = "age_in_versions"
DOWNLINK = "downlink"  # "dense" or "patch"
BASE_VERSION = "base_version"  # the version a patch applies to (the newest of BASE_VERSIONS)
BASE_VERSIONS = "base_versions"  # every version the patch applies to (the client may hold any)
KEEP_MODEL = "keep_model"  # keep the received model so that later messages may be patches
INITIAL_GRID = "initial_grid"  # version 0 has its matrices on the int8 grid (dgc.int8_grid)
CONFIG_DIGEST = "config_digest"  # digest of the run's config (config_digest)

#: What a client's error says when a message names a run config it does not hold: the server
#: sends that config whole to it next time.
CONFIG_MISSING = "fedgc-config-missing"

#: The reply metric of the examples a client trained on (Flower's name; the aggregation weight).
NUM_EXAMPLES = "num-examples"
#: Metrics every train reply carries (what the server reads: the weight, the loss and the
#: compute time it records).
REPLY_METRICS = (NUM_EXAMPLES, "train_loss", "compute_seconds")
#: Metric a train reply carries only when it is not 0: how many unaggregated updates the client
#: folded back into its residual.
RESTORED = "restored"
#: Metric a train reply carries only when the client found its state record damaged, moved it
#: aside (``<key>.state.corrupt-<n>``) and trained from the global model with an empty residual:
#: 1. What the lost residual and pending update held cannot be known (the record failed its
#: CRC, so no number read from it can be trusted); the metric marks the round in which that
#: mass left the federation. Left out of every other reply, so that a reply's size (which the
#: network emulator charges) is unchanged.
STATE_QUARANTINED = "state_quarantined"

#: The metric a query reply carries: the client's stable key (its partition id in simulation).
CLIENT_KEY = "client_key"


def bytes_to_record(data: bytes, name: str = UPDATE) -> ArrayRecord:
    """Wrap encoded bytes as an ArrayRecord with one uint8 Array (Flower carries it unchanged)."""
    return ArrayRecord({name: Array(dtype="uint8", shape=(len(data),), stype=WIRE_STYPE,
                                    data=bytes(data))})


def record_to_bytes(record: ArrayRecord, name: str = UPDATE) -> bytes:
    """The bytes of :func:`bytes_to_record`; a ValueError names what is missing or wrong."""
    if name not in record:
        raise ValueError(f"ArrayRecord lacks the byte array {name!r}; it holds {list(record)}")
    arr = record[name]
    if arr.stype != WIRE_STYPE:
        raise ValueError(f"array {name!r} has stype {arr.stype!r}, expected {WIRE_STYPE!r}")
    return bytes(arr.data)


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of an ArrayRecord as sent: the serialized data of every Array."""
    return sum(len(a.data) for a in record.values())


def reply_metrics(*, num_examples: int, train_loss: float, compute_seconds: float,
                  restored: int = 0, state_quarantined: bool = False) -> dict[str, int | float]:
    """The metrics of a train reply (:data:`REPLY_METRICS`, in that order), typed as sent.

    ``restored`` (:data:`RESTORED`: the client folded unaggregated updates back into its
    residual) and ``state_quarantined`` (:data:`STATE_QUARANTINED`) are added only when not 0,
    so that a reply's size is the same in every ordinary round.
    """
    metrics: dict[str, int | float] = {
        NUM_EXAMPLES: int(num_examples),
        "train_loss": float(train_loss),
        "compute_seconds": float(compute_seconds),
    }
    if restored:
        metrics[RESTORED] = int(restored)
    if state_quarantined:
        metrics[STATE_QUARANTINED] = 1
    return metrics


def config_digest(run_config: Mapping[str, object]) -> str:
    """A digest of a run's config (16 hex digits of BLAKE2b over its keys, values and their
    types, in key order): equal configs, and only they, share it."""
    items = sorted((str(k), type(v).__name__, v if not isinstance(v, (list, tuple)) else list(v))
                   for k, v in run_config.items())
    text = json.dumps(items, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def reply_content(update: bytes, metrics: Mapping[str, int | float],
                  shared_signs: bytes | None = None) -> RecordDict:
    """The content of a train reply: the encoded update, the metrics, the signs if any."""
    content = RecordDict({UPDATE: bytes_to_record(update), METRICS: MetricRecord(dict(metrics))})
    if shared_signs is not None:
        content[SHARED] = bytes_to_record(shared_signs, SHARED_SIGNS)
    return content
