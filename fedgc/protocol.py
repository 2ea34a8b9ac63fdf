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
from collections.abc import Mapping, Sequence

import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

import dgc
from dgc.wire import max_numel_of
from dgc.wire.compact import COMPACT_MAGIC, decode_compact
from fedgc import context_patch

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
PATCH_ADD = "patch_add"  # tensors whose patch values are added to the held ones (one base only)
INITIAL_GRID = "initial_grid"  # version 0 has its matrices on the int8 grid (dgc.int8_grid)
#: Tensors of a patch on one base sent as segments of the ranking by displacement from version 0
#: (``downlink_context``, :mod:`fedgc.context_patch`).
PATCH_CONTEXT = "patch_context"
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


class ProtocolError(ValueError):
    """A message that does not follow the contract (a missing key, a patch that does not fit)."""


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


def apply_patch(model: Mapping[str, torch.Tensor], patch: bytes,
                added: Sequence[str] = (),
                context: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model a patch makes of ``model`` (which is left unchanged).

    ``patch`` is ``dgc.encode`` output (or a compact message, :mod:`dgc.wire.compact`, on the
    layout of the model and its ranked tensors' segments) whose values replace the entries at
    its indices, except
    in the tensors named in ``added`` (``patch_add``), whose values are differences to add.
    ``context`` (``patch_context``): per tensor sent as segments of its ranking by displacement,
    that tensor of version 0 (:mod:`fedgc.context_patch`). A patch tensor the model lacks, of
    another size, a tensor sent both whole and as segments, or an ``added`` name the patch lacks
    is a :class:`ProtocolError` (``dgc.DecodeError`` for bytes that do not decode).
    """
    limit = max_numel_of(t.shape for t in model.values())
    if bytes(patch[:4]) == COMPACT_MAGIC:  # downlink_compact: tensors by place (dgc.wire.compact)
        if unknown := sorted(set(context or {}) - set(model)):
            raise ProtocolError(f"{PATCH_CONTEXT} names tensors the model lacks: {unknown}")
        layout = context_patch.patch_layout({k: tuple(v.shape) for k, v in model.items()},
                                            sorted(context or {}))
        update = decode_compact(patch, layout, max_numel=limit)
    else:
        update = dgc.decode(patch, max_numel=limit)
    tensors = dict(update.tensors)
    if context:
        tensors = _joined(model, tensors, context)
    if unknown := sorted(set(added) - set(tensors)):
        raise ProtocolError(f"{PATCH_ADD} names tensors the patch lacks: {unknown}")
    for name, t in tensors.items():
        if name not in model or model[name].numel() != t.numel:
            raise ProtocolError(f"patch tensor {name!r} does not match the held model")
    out = {k: v.clone() for k, v in model.items()}
    for name, t in tensors.items():
        flat = out[name].view(-1)
        if name in added:
            flat[t.indices] += t.values.to(flat.dtype)
        else:
            flat[t.indices] = t.values.to(flat.dtype)
    return out


def _joined(model: Mapping[str, torch.Tensor], tensors: Mapping[str, dgc.SparseTensor],
            context: Mapping[str, torch.Tensor]) -> dict[str, dgc.SparseTensor]:
    """``tensors`` with the segments of each tensor of ``context`` joined back into it, on the
    ranking of the held model's tensor against version 0."""
    if unknown := sorted(set(context) - set(model)):
        raise ProtocolError(f"{PATCH_CONTEXT} names tensors the model lacks: {unknown}")
    if both := sorted(set(context) & set(tensors)):
        raise ProtocolError(f"patch sends {both} both whole and as {PATCH_CONTEXT} segments")
    out, segments = {}, {}
    for name, t in tensors.items():
        owner = context_patch.segment_owner(name, context)
        if owner is None:
            out[name] = t
        else:
            segments.setdefault(owner, {})[name] = t
    for name, parts in segments.items():
        try:
            order = context_patch.rank_order(model[name], context[name])
            out[name] = context_patch.join(name, parts, order)
        except context_patch.ContextError as ex:
            raise ProtocolError(f"{PATCH_CONTEXT} tensor {name!r}: {ex}") from ex
    return out
