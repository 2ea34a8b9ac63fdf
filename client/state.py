"""The client's state between rounds: the typed :class:`ClientState` and the store that keeps it.

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

What a record holds is the :class:`ClientState` dataclass, versioned by its ``state_version`` key
(:data:`STATE_VERSION`); records written before the key existed are version 1, with the same
fields. A damaged record raises :class:`StateCorruptError`, which the client answers by moving
the file aside (:meth:`ClientStateStore.quarantine`) and starting again from the global model.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dgc import Compressor
from fedgc.files import atomic_write_bytes
from fedgc.keys import TrainSettings
from fedgc.methods import Method, pending_parts
from fedgc.methods.unaggregated import fold_back
from fedgc.ownership import note_written

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


class StateCorruptError(StateStoreError):
    """A client state file is damaged (truncated, failed its CRC, malformed): its content is
    lost. ``path`` is the file."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class StateVersionError(StateStoreError):
    """A client state record of a version this code does not read (written by a newer fedgc)."""


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
        raise StateCorruptError(f"{where} is truncated: {len(view)} bytes, shorter than any record")
    magic, version, header_nbytes, data_nbytes = _PRELUDE.unpack_from(view, 0)
    if magic != RECORD_MAGIC:
        raise StateCorruptError(f"{where} is not a client state record: magic {bytes(magic)!r}, "
                              f"expected {RECORD_MAGIC!r}")
    if version != RECORD_VERSION:
        raise StateVersionError(f"{where} has record format version {version}, this store "
                                f"reads {RECORD_VERSION}")
    start = _aligned(_PRELUDE.size + header_nbytes)
    expected = start + data_nbytes + _CRC.size
    if len(view) != expected:
        raise StateCorruptError(f"{where} is {'truncated' if len(view) < expected else 'too long'}"
                              f": {len(view)} bytes, its header says {expected}")
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    if zlib.crc32(view[:len(view) - _CRC.size]) != crc:
        raise StateCorruptError(f"{where} is corrupt: CRC32 mismatch")
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
        raise StateCorruptError(f"{where} has a malformed header: {ex}") from ex
    if not isinstance(record, dict):
        raise StateCorruptError(f"{where} holds {type(record).__name__}, expected a dict")
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
    temporary file in the same folder, fsync-ed and moved into place with ``os.replace``
    (:func:`fedgc.files.atomic_write`), so a crash leaves either the old or the new record, never
    a torn one; a damaged file (truncated, corrupted: the CRC32 covers every byte) raises
    :class:`StateCorruptError` naming it. A record
    of an earlier version (``<key>.pt``, ``torch.save``) is still read, and replaced by the next
    write. Every file the store creates is listed in the folder's manifest
    (:func:`fedgc.ownership.note_written`), which is what ``overwrite=true`` deletes.
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
        try:
            return decode_record(data, f"client state {path}")
        except StateCorruptError as ex:
            ex.path = path
            raise

    def _get_legacy(self, key: str) -> dict[str, Any] | None:
        path = self._path(key, LEGACY_SUFFIX)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as ex:  # torch raises several types for a damaged file
            raise StateCorruptError(f"client state {path} is unreadable: {ex}", path) from ex
        if not isinstance(record, dict):
            raise StateCorruptError(f"client state {path} holds {type(record).__name__}, "
                                    f"expected a dict", path)
        return record

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Store ``record`` under ``key``, replacing any previous one atomically."""
        if not isinstance(record, dict):
            raise StateStoreError(f"a client state record must be a dict, got "
                                  f"{type(record).__name__}")
        path = self._path(key)
        parts = encode_record(record)  # before the temporary file: a bad record leaves none
        if not path.exists():
            # Listed before it exists: overwrite=true deletes only what a manifest lists.
            note_written(self.root, path.name)
        atomic_write_bytes(path, parts)
        self._path(key, LEGACY_SUFFIX).unlink(missing_ok=True)

    def load(self, key: str) -> ClientState | None:
        """The :class:`ClientState` stored under ``key``, or None when the client has none yet.

        A damaged file raises :class:`StateCorruptError`; a record of an unknown version
        :class:`StateVersionError`.
        """
        record = self.get(key)
        return None if record is None else ClientState.from_record(record, f"client state {key}")

    def save(self, key: str, state: ClientState) -> None:
        """Store ``state`` under ``key`` (atomically, see :meth:`put`)."""
        self.put(key, state.to_record())

    def quarantine(self, path: Path) -> Path:
        """Move a damaged record file aside, to ``<name>.corrupt-<n>`` (the first free n).

        The file is kept for inspection, out of the store's way: :meth:`get` then finds no
        record, and :meth:`keys` and :meth:`nbytes` no longer count it. Returns the new path.
        """
        path = Path(path)
        if path.parent != self.root:
            raise StateStoreError(f"{path} is not a record of the store in {self.root}")
        n = 1
        while True:
            target = path.with_name(f"{path.name}.corrupt-{n}")
            try:
                # os.link refuses an existing target, so two processes cannot pick the same n.
                os.link(path, target)
            except FileExistsError:
                n += 1
                continue
            note_written(self.root, target.name)  # after the link: a name this call created
            path.unlink()
            return target

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


#: Version of the :class:`ClientState` record this code writes. 1: the untyped dict of the first
#: releases (no ``state_version`` key, the same fields but ``quarantined``); 2: this one.
STATE_VERSION = 2
_READS = (1, 2)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass
class ClientState:
    """What a client keeps between rounds (one record per client key in the store).

    Parameters
    ----------
    compressor : dict or None
        The compressor's ``state_dict()``: residual and momentum (``dgc`` runs only).
    pending : bytes or None
        The ``dgc.encode``-d update last sent. The next round folds it back into the residual
        unless the server acknowledged its sequence (``ack_sequence``).
    pending_shared, pending_mask : bytes or None
        The side part sent beside ``pending`` (DGC's shared signs), and the round material
        that ``pending`` and the side part answered (the index sets or mask,
        ``dgc.signs.codec.encode_mask``); folded back with it.
    reply : dict or None
        The last reply's metrics without ``compute_seconds``: a round the server re-sends (after
        a resume) is answered with the same bytes instead of being trained again.
    model : dict or None
        The global model version the client holds (with ``keep_model``), so that the server may
        send a patch on it; ``model_version`` is its version.
    model_version : int or None
        Version of ``model``.
    quarantined : int
        Damaged records moved aside since the last reply (reported once, as the reply metric
        ``state_quarantined``).
    """

    compressor: dict[str, Any] | None = None
    pending: bytes | None = None
    pending_shared: bytes | None = None
    pending_mask: bytes | None = None
    reply: dict[str, int | float] | None = None
    model: dict[str, torch.Tensor] | None = None
    model_version: int | None = None
    quarantined: int = 0

    _BYTES = ("pending", "pending_shared", "pending_mask")

    def to_record(self) -> dict[str, Any]:
        """The store's record of this state (version :data:`STATE_VERSION`; None fields left out;
        byte fields as uint8 tensors)."""
        record: dict[str, Any] = {"state_version": STATE_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "quarantined" and not value):
                continue
            record[f.name] = _bytes_tensor(value) if f.name in self._BYTES else value
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str = "record") -> ClientState:
        """The state of a record of any version this code reads; another version is a
        :class:`StateVersionError`, an unknown field or a wrong type a :class:`StateCorruptError`,
        each naming ``where``."""
        values = dict(record)
        version = values.pop("state_version", 1)
        if version not in _READS:
            raise StateVersionError(f"{where} has client state version {version!r}; this fedgc "
                                    f"reads versions {list(_READS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        if version == 1:
            known.discard("quarantined")
        if unknown := sorted(set(values) - known):
            raise StateCorruptError(f"{where} (version {version}) holds unknown fields {unknown}")
        for name in cls._BYTES:
            if name in values:
                t = values[name]
                if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                    raise StateCorruptError(f"{where}: {name} must be a uint8 tensor, got "
                                            f"{type(t).__name__}")
                values[name] = bytes(t.numpy().tobytes())
        for name, kind in (("compressor", dict), ("reply", dict), ("model", dict),
                           ("model_version", int), ("quarantined", int)):
            if name in values and not isinstance(values[name], kind):
                raise StateCorruptError(f"{where}: {name} must be a {kind.__name__}, got "
                                        f"{type(values[name]).__name__}")
        return cls(**values)


def update_age(reply: Mapping[str, Any] | None, sequence: int, server_round: int,
               model_version: int | None = None) -> int:
    """How old a client's last update is at ``server_round``: that round less ``sequence``, the
    round it was computed in; with ``model_version`` (an asynchronous dispatch, whose sequences
    count dispatches, not steps) that version less the one the update trained on, as ``reply``
    (the state's record of it) kept it; a reply without it: the sequences'."""
    trained_on = None if reply is None else reply.get("model_version")
    if model_version is not None and isinstance(trained_on, int):
        return int(model_version) - trained_on
    return int(server_round) - int(sequence)


def fold_back_pending(compressor: Compressor, state: ClientState | Mapping[str, Any],
                      ack_sequence: int, shapes: Mapping[str, tuple[int, ...]],
                      method: Method, train: TrainSettings, server_round: int,
                      model_version: int | None = None) -> bool:
    """Restore into ``compressor`` what the method keeps of a state's last update, unless the
    server aggregated it.

    The state keeps the payload it sent as ``pending`` (wire bytes) and, with a side part (the
    shared sign channel), the side part sent beside it (``pending_shared``) with the round
    material it answers (``pending_mask``). When the payload's sequence is not ``ack_sequence``
    they go back into the residual, scaled by the share the method's
    :meth:`~fedgc.methods.Method.unaggregated` gives for its age and its size: all of it,
    decayed, capped or none (:mod:`fedgc.methods.unaggregated`). The age is ``server_round``
    less the round it was computed in; with ``model_version`` (an asynchronous dispatch, whose
    sequences count dispatches, not steps) that version less the one the update trained on,
    as the state recorded it (a record without it: the sequences'); at least 1 either way.
    ``shapes`` gives each tensor's shape; the run's
    ``method`` reads the bytes (:func:`fedgc.methods.pending_parts`) with the run's ``train``
    settings. Returns whether anything was folded back (an unaggregated update discarded:
    False). ``state`` may be a store record (the emulator's stale policy works on those).
    """
    if not isinstance(state, ClientState):
        state = ClientState.from_record(state)
    if state.pending is None:
        return False
    sequence, parts = pending_parts(method, train, state.pending, state.pending_shared,
                                    state.pending_mask, shapes)
    if sequence == ack_sequence:
        return False
    age = max(1, update_age(state.reply, sequence, server_round, model_version))
    share = fold_back(compressor, parts,
                      lambda folded, residual: method.unaggregated(train, age, folded, residual))
    return share > 0.0
