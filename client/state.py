"""ClientStateStore: per-client state (compressor residual, pending update, held model) off-heap.

Flower's ``context.state`` lives in the simulation driver's memory for every node, and Flower
updates it even for a client whose reply timed out; thousands of dense residuals would neither fit
nor be trustworthy there. The store keeps one record per client key in a folder instead, written
atomically, so the network-emulator work can later swap in a bounded or compressed store behind
the same two methods.

A record is written in a flat format of its own (:func:`encode_record`): a JSON skeleton of the
record's dicts, lists and numbers, then every tensor's raw bytes, then a CRC32. A client writes
its ~4 MB record every time it trains, and ``torch.save`` (a zip archive of pickles) spent about as
long on that as the training did; this format is one ``writev`` of the tensors' own memory, and a
read is one ``readinto`` with the tensors left in place in that buffer.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import dgc
from dgc import Compressor
from dgc.signs.codec import decode_mask, decode_signs

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

#: File name suffix of a record; records of earlier versions (``torch.save``) end in ``.pt``.
SUFFIX = ".state"
LEGACY_SUFFIX = ".pt"

RECORD_MAGIC = b"FGCR"
RECORD_VERSION = 1
# magic, version, reserved, skeleton bytes, data bytes; then the skeleton (JSON), zero padding to
# _ALIGN, the data section (each tensor at an _ALIGN-aligned offset) and a CRC32 of all before it.
_PRELUDE = struct.Struct("<4sB3xIQ")
_CRC = struct.Struct("<I")
_ALIGN = 64
_TAG = "$"  # skeleton objects whose only key starts with it stand for a tensor or a tuple

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
    torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}
_DTYPE_OF = {name: dtype for dtype, name in _DTYPES.items()}


class StateStoreError(RuntimeError):
    """A client state record could not be read or written."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _skeleton(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    """``value`` as JSON-able data, with each tensor replaced by ``{"$t": its index}``."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise StateStoreError(f"cannot store {path}: tensor dtype {value.dtype} is not one "
                                  f"of {sorted(_DTYPES.values())}")
        tensors.append(value)
        return {_TAG + "t": len(tensors) - 1}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k.startswith(_TAG):
                raise StateStoreError(f"cannot store {path}: its keys must be strings not "
                                      f"starting with {_TAG!r}, got {k!r}")
            out[k] = _skeleton(v, tensors, f"{path}.{k}")
        return out
    if isinstance(value, tuple):
        return {_TAG + "tuple": [_skeleton(v, tensors, f"{path}[{i}]")
                                 for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_skeleton(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise StateStoreError(f"cannot store {path}: a {type(value).__name__} (a record holds dicts "
                          f"with string keys, lists, tuples, tensors, numbers, strings and None)")


def encode_record(record: Mapping[str, Any]) -> list[memoryview | bytes]:
    """The bytes of ``record`` in the store's format, as buffers to write one after another.

    The tensors' bytes are not copied: the buffers view the (contiguous CPU) tensors' memory.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(record, tensors, "record")
    specs: list[list[Any]] = []
    views: list[tuple[int, Any]] = []
    offset = 0
    for t in tensors:
        t = t.detach().cpu().contiguous()
        if not t.numel():
            specs.append([_DTYPES[t.dtype], list(t.shape), 0, 0])
            continue
        raw = t.reshape(-1).view(torch.uint8).numpy()
        specs.append([_DTYPES[t.dtype], list(t.shape), offset, raw.nbytes])
        views.append((offset, raw))
        offset = _aligned(offset + raw.nbytes)
    header = json.dumps({"record": skeleton, "tensors": specs}, allow_nan=True,
                        separators=(",", ":")).encode("utf-8")
    start = _aligned(_PRELUDE.size + len(header))
    data_nbytes = views[-1][0] + views[-1][1].nbytes if views else 0
    parts: list[memoryview | bytes] = [
        _PRELUDE.pack(RECORD_MAGIC, RECORD_VERSION, len(header), data_nbytes), header,
        bytes(start - _PRELUDE.size - len(header))]
    at = 0
    for o, raw in views:
        if o > at:
            parts.append(bytes(o - at))
        parts.append(memoryview(raw))
        at = o + raw.nbytes
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    parts.append(_CRC.pack(crc))
    return parts


def decode_record(data: bytearray, where: str = "record") -> dict[str, Any]:
    """The record of :func:`encode_record` bytes; every defect is a StateStoreError naming
    ``where``. The returned tensors share ``data``'s memory (no copy)."""
    view = memoryview(data)
    if len(view) < _PRELUDE.size + _CRC.size:
        raise StateStoreError(f"{where} is truncated: {len(view)} bytes, shorter than any record")
    magic, version, header_nbytes, data_nbytes = _PRELUDE.unpack_from(view, 0)
    if magic != RECORD_MAGIC:
        raise StateStoreError(f"{where} is not a client state record: magic {bytes(magic)!r}, "
                              f"expected {RECORD_MAGIC!r}")
    if version != RECORD_VERSION:
        raise StateStoreError(f"{where} has record version {version}, this store reads "
                              f"{RECORD_VERSION}")
    start = _aligned(_PRELUDE.size + header_nbytes)
    expected = start + data_nbytes + _CRC.size
    if len(view) != expected:
        raise StateStoreError(f"{where} is {'truncated' if len(view) < expected else 'too long'}"
                              f": {len(view)} bytes, its header says {expected}")
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    if zlib.crc32(view[:len(view) - _CRC.size]) != crc:
        raise StateStoreError(f"{where} is corrupt: CRC32 mismatch")
    try:
        header = json.loads(bytes(view[_PRELUDE.size:_PRELUDE.size + header_nbytes]))
        specs = header["tensors"]
        tensors = []
        for name, shape, offset, nbytes in specs:
            dtype = _DTYPE_OF[name]
            numel = 1
            for d in shape:
                numel *= int(d)
            if offset < 0 or offset + nbytes > data_nbytes \
                    or nbytes != numel * torch.empty(0, dtype=dtype).element_size():
                raise ValueError(f"tensor of {shape} {name} at {offset}+{nbytes} does not fit "
                                 f"the {data_nbytes}-byte data section")
            if numel == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
            else:
                tensors.append(torch.frombuffer(data, dtype=dtype, count=numel,
                                                offset=start + offset).view(shape))
        record = _unskeleton(header["record"], tensors)
    except (ValueError, KeyError, TypeError, IndexError) as ex:
        raise StateStoreError(f"{where} has a malformed header: {ex}") from ex
    if not isinstance(record, dict):
        raise StateStoreError(f"{where} holds {type(record).__name__}, expected a dict")
    return record


def _unskeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if len(value) == 1:
            (k, v), = value.items()
            if k == _TAG + "t":
                return tensors[v]
            if k == _TAG + "tuple":
                return tuple(_unskeleton(x, tensors) for x in v)
        return {k: _unskeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unskeleton(v, tensors) for v in value]
    return value


class ClientStateStore:
    """A folder of records, one file per client key (``<key>.state``).

    Parameters
    ----------
    root : str or Path
        Folder of the records; created when missing.

    Notes
    -----
    Records are dicts (string keys) of dicts, lists, tuples, CPU tensors, numbers, strings and
    None, in the format of :func:`encode_record`; reading one runs no code. A write goes to a
    temporary file in the same folder and is moved into place with ``os.replace``, so a crash
    leaves either the old or the new record, never a torn one; a damaged file (truncated,
    corrupted: the CRC32 covers every byte) raises :class:`StateStoreError` naming it. A record
    of an earlier version (``<key>.pt``, ``torch.save``) is still read, and replaced by the next
    write.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str, suffix: str = SUFFIX) -> Path:
        key = str(key)
        if not _KEY.match(key):
            raise StateStoreError(f"client key {key!r} must match {_KEY.pattern}")
        return self.root / f"{key}{suffix}"

    def get(self, key: str) -> dict[str, Any] | None:
        """The record stored under ``key``, or None when the client has none yet."""
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                data = bytearray(os.fstat(fh.fileno()).st_size)
                got = fh.readinto(data)
        except FileNotFoundError:
            return self._get_legacy(key)
        if got != len(data):
            raise StateStoreError(f"client state {path} changed while it was read")
        return decode_record(data, f"client state {path}")

    def _get_legacy(self, key: str) -> dict[str, Any] | None:
        path = self._path(key, LEGACY_SUFFIX)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as ex:  # torch raises several types for a damaged file
            raise StateStoreError(f"client state {path} is unreadable: {ex}") from ex
        if not isinstance(record, dict):
            raise StateStoreError(f"client state {path} holds {type(record).__name__}, "
                                  f"expected a dict")
        return record

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Store ``record`` under ``key``, replacing any previous one atomically."""
        if not isinstance(record, dict):
            raise StateStoreError(f"a client state record must be a dict, got "
                                  f"{type(record).__name__}")
        path = self._path(key)
        parts = encode_record(record)  # before the temporary file: a bad record leaves none
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb", buffering=0) as fh:
                for part in parts:
                    view = memoryview(part)
                    while view.nbytes:  # a raw write may be short
                        view = view[fh.write(view):]
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._path(key, LEGACY_SUFFIX).unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        """Forget the record of ``key`` (no error when there is none)."""
        self._path(key).unlink(missing_ok=True)
        self._path(key, LEGACY_SUFFIX).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Client keys that have a record, sorted."""
        return sorted({p.name[:-len(s)] for s in (SUFFIX, LEGACY_SUFFIX)
                       for p in self.root.glob(f"*{s}") if not p.name.startswith(".")})

    def nbytes(self) -> int:
        """Bytes the records take on disk (file sizes)."""
        return sum(p.stat().st_size for s in (SUFFIX, LEGACY_SUFFIX)
                   for p in self.root.glob(f"*{s}") if not p.name.startswith("."))


def stored_bytes(record: dict[str, Any], key: str) -> bytes:
    """The bytes a record keeps as a uint8 tensor (``pending``, ``pending_shared``, ...)."""
    return bytes(record[key].numpy().tobytes())


def fold_back_pending(compressor: Compressor, record: dict[str, Any], ack_sequence: int,
                      numels: dict[str, int]) -> bool:
    """Restore a record's last update into ``compressor`` unless the server aggregated it.

    The record (``client.app``'s format) keeps the update it sent as ``pending`` (wire bytes)
    and, with the shared sign channel, the signs sent beside it (``pending_shared``) with the
    index sets they answer (``pending_mask``). When the update's sequence is not
    ``ack_sequence`` both go back into the residual, so nothing the client computed is lost.
    ``numels`` gives each tensor's size. Returns whether anything was restored.
    """
    if record.get("pending") is None:
        return False
    pending = dgc.decode(stored_bytes(record, "pending"), max_numel=max(numels.values(), default=0))
    if pending.sequence == ack_sequence:
        return False
    compressor.restore(pending)
    if "pending_shared" in record:
        _, masks = decode_mask(stored_bytes(record, "pending_mask"), numels)
        compressor.restore(decode_signs(stored_bytes(record, "pending_shared"), masks,
                                        {name: (n,) for name, n in numels.items()}))
    return True
