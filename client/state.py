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
