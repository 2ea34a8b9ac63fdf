"""Atomic file writes: the one way fedgc replaces a file that a crash must not leave torn."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Replace ``path`` by what ``write`` writes to a binary file, atomically.

    ``write`` fills a temporary file in ``path``'s folder (so that ``os.replace`` is a rename
    within one file system); the file is flushed and fsync-ed before the rename, so after a
    crash, power loss included, ``path`` holds either its old or its new content, never a mix.
    The temporary file is removed when ``write`` raises. The folder is created when missing.
    Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike[str],
                       parts: bytes | memoryview | Iterable[bytes | memoryview]) -> Path:
    """:func:`atomic_write` of ``parts``, one buffer or several written one after another."""
    buffers = [parts] if isinstance(parts, (bytes, bytearray, memoryview)) else list(parts)

    def write(fh: BinaryIO) -> None:
        for part in buffers:
            fh.write(part)

    return atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write` of ``text`` in UTF-8, line endings as given."""
    return atomic_write_bytes(path, text.encode("utf-8"))
