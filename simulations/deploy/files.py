"""Files and folders of a deployment that only its user may read: folders 0700, keys 0600.

Both are created with their final mode (``mkdir(mode=...)``, ``os.open(..., 0o600)``), never
created with the defaults and narrowed afterwards: there is no moment at which another user can
open a key or list a folder.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER_MODE = 0o700
KEY_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700; an existing folder is left as is."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        # exist_ok: another process may create the same folder at the same moment.
        folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
    return path


def write_private(path: Path, data: bytes) -> Path:
    """Write ``data`` to a new file created with mode 0600 (an older file is replaced)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_MODE)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path
