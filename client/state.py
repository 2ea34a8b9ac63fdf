"""ClientStateStore: per-client state (compressor residual, pending update, held model) off-heap.

Flower's ``context.state`` lives in the simulation driver's memory for every node, and Flower
updates it even for a client whose reply timed out; thousands of dense residuals would neither fit
nor be trustworthy there. The store keeps one record per client key in a folder instead, written
atomically, so the network-emulator work can later swap in a bounded or compressed store behind
the same two methods.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

import dgc
from dgc.shared import decode_mask, decode_signs

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class StateStoreError(RuntimeError):
    """A client state record could not be read or written."""


class ClientStateStore:
    """A folder of ``torch.save`` records, one file per client key.

    Parameters
    ----------
    root : str or Path
        Folder of the records; created when missing.

    Notes
    -----
    Records are plain dicts of tensors, numbers and strings, loaded with ``weights_only=True``
    (no pickled code runs). A write goes to a temporary file in the same folder and is moved into
    place with ``os.replace``, so a crash leaves either the old or the new record, never a torn one.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        key = str(key)
        if not _KEY.match(key):
            raise StateStoreError(f"client key {key!r} must match {_KEY.pattern}")
        return self.root / f"{key}.pt"

    def get(self, key: str) -> dict[str, Any] | None:
        """The record stored under ``key``, or None when the client has none yet."""
        path = self._path(key)
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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(record, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, key: str) -> None:
        """Forget the record of ``key`` (no error when there is none)."""
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Client keys that have a record, sorted."""
        return sorted(p.stem for p in self.root.glob("*.pt"))


def stored_bytes(record: dict[str, Any], key: str) -> bytes:
    """The bytes a record keeps as a uint8 tensor (``pending``, ``pending_shared``, ...)."""
    return bytes(record[key].numpy().tobytes())


def fold_back_pending(compressor: Any, record: dict[str, Any], ack_sequence: int,
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
    pending = dgc.decode(stored_bytes(record, "pending"))
    if pending.sequence == ack_sequence:
        return False
    compressor.restore(pending)
    if "pending_shared" in record:
        _, masks = decode_mask(stored_bytes(record, "pending_mask"), numels)
        compressor.restore(decode_signs(stored_bytes(record, "pending_shared"), masks,
                                        {name: (n,) for name, n in numels.items()}))
    return True
