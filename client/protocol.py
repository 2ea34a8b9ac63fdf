"""The message contract between DGCStrategy and the ClientApp: record keys and byte payloads.

A train message carries

- ``config`` (ConfigRecord): the :class:`client.settings.TrainSettings` keys plus the per-node
  keys below;
- ``arrays`` (ArrayRecord): either the dense global model (one numpy Array per tensor, what
  Flower's FedAvg sends), or one byte Array named ``patch``: a ``dgc.encode``-d update whose
  fp32 values *replace* the entries of the model version the client already holds
  (``base_version``, or any of ``base_versions``: the server may not know which of them the
  client holds, and the patch carries every entry that differs in any of them). Replacing
  instead of adding keeps the client's copy bit-identical to the server's. The exception is a
  patch on one base version with ``patch_add``: for the tensors it names the values are
  differences to *add* (int8-grid broadcasts, where the server checked that the sums are exact).

A DGC train message may also carry ``shared`` (ArrayRecord with one byte Array
``shared_mask``: the round's shared index sets, ``dgc.shared.encode_mask``). The client then
sends its residual at those indices as scaled signs.

A train reply carries ``update`` (ArrayRecord with one byte Array: the ``dgc.encode``-d
pseudo-gradient), for a message with index sets ``shared`` (one byte Array ``shared_signs``:
``dgc.shared.encode_signs``), and ``metrics`` (MetricRecord, keys in
:data:`REPLY_METRICS`).
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord

#: stype of a byte Array that holds ``dgc.encode`` output.
WIRE_STYPE = "fedgc.dgc.wire"

# Record keys.
ARRAYS = "arrays"
CONFIG = "config"
UPDATE = "update"
METRICS = "metrics"
PATCH = "patch"
SHARED = "shared"  # ArrayRecord of the shared-index channel (dgc.shared), both directions
SHARED_MASK = "shared_mask"  # its byte Array in a train message
SHARED_SIGNS = "shared_signs"  # its byte Array in a train reply
NODE = "node"  # ConfigRecord of a reply from a Ray worker: ray_node, host (client.node)

# Per-node config keys the server adds to the TrainSettings keys.
SERVER_ROUND = "server-round"
ACK_SEQUENCE = "ack_sequence"  # sequence of this client's last update that was aggregated; -1 none
MODEL_VERSION = "model_version"  # version of the model in this message
DOWNLINK = "downlink"  # "dense" or "patch"
BASE_VERSION = "base_version"  # the version a patch applies to (the newest of BASE_VERSIONS)
BASE_VERSIONS = "base_versions"  # every version the patch applies to (the client may hold any)
KEEP_MODEL = "keep_model"  # keep the received model so that later messages may be patches
PATCH_ADD = "patch_add"  # tensors whose patch values are added to the held ones (one base only)
INITIAL_GRID = "initial_grid"  # version 0 has its matrices on the int8 grid (dgc.grid)

#: Metrics every train reply carries.
REPLY_METRICS = ("num-examples", "uplink_bytes", "nnz", "shared_entries", "density",
                 "train_loss", "compute_seconds", "model_version", "client_key", "sequence",
                 "restored")

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
