"""Reading a dataset's files within bounds: every size checked before anything is allocated.

A server may name a node's ``data_dir`` (docs/threat_model.md), so what lies there is read as
untrusted: a file must be a regular file (a FIFO or ``/dev/zero`` would never end) of at most
the bound its format allows, checked on the file before it is read; a gzip stream is inflated
in pieces, never past what the caller expects; anything else is a one-line
:class:`tasks.errors.DataError` naming the file. Issue 35: a 26 MB gzip idx file ended in a
``MemoryError`` traceback (19 frames), where each bound below now refuses it in one line.
"""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path

from tasks.errors import DataError

__all__ = ["check_file", "gunzip", "read_file"]

#: Bytes inflated from a gzip stream at a time.
_CHUNK = 1 << 20


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def check_file(path: Path, limit: int, what: str) -> int:
    """The size of ``path``, a regular file (a link to one counts) of at most ``limit`` bytes;
    DataError otherwise, naming ``what`` it was read as."""
    try:
        info = os.stat(path)
    except OSError as ex:
        raise DataError(f"{path}: cannot read {what} ({ex.strerror or ex})") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"{path}: {what} must be a regular file, not a device, FIFO or folder")
    if info.st_size > limit:
        raise DataError(f"{path}: {info.st_size} bytes, more than {what} may hold "
                        f"({_mib(limit)})")
    return info.st_size


def read_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (:func:`check_file`), read once its size passed."""
    size = check_file(path, limit, what)
    with open(path, "rb") as fh:
        data = fh.read(size)  # the checked size: a read of more allocates that much first
        grew = fh.read(1)
    if len(data) != size or grew:
        raise DataError(f"{path}: {what} changed while it was read")
    return data


def gunzip(data: bytes, want: int, path: Path, what: str, first: int = 0) -> bytes:
    """The gzip stream ``data`` inflated to exactly ``want`` bytes, never more (with
    ``first`` > 0: its first ``first`` bytes only, the stream left unread after them).

    Raises
    ------
    DataError
        The stream is damaged, ends before ``want`` bytes, or holds more (a gzip bomb stops
        at ``want + 1``).
    """
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    limit = first or want
    out = bytearray()
    rest = data
    try:
        while len(out) <= limit and (rest or not inflater.eof):
            piece = inflater.decompress(rest, min(_CHUNK, limit + 1 - len(out)))
            rest = inflater.unconsumed_tail
            out += piece
            if not piece and (inflater.eof or not rest):
                break
    except zlib.error as ex:
        raise DataError(f"{path}: corrupt gzip stream in {what} ({ex})") from None
    if first:
        if len(out) < first:
            raise DataError(f"{path}: {what} ends after {len(out)} bytes, before its header")
        return bytes(out[:first])
    if len(out) > want:
        raise DataError(f"{path}: {what} inflates to more than the {want} bytes its header "
                        f"says")
    if len(out) < want or not inflater.eof:
        raise DataError(f"{path}: {what} inflates to {len(out)} bytes, its header says {want} "
                        f"(a truncated or corrupt gzip stream)")
    return bytes(out)
