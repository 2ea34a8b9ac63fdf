"""Which run owns a folder, and which files it wrote there: the mark and the manifest.

A results folder belongs to one run or one comparison, a ``state_dir`` to one run: fedgc marks
each when it first uses it (:data:`MARK`, a small JSON file naming the kind, the run's id and
the folder it names the run by) and refuses it to anyone else, naming the owner
(:func:`claim`). Two runs in one ``state_dir`` mixed their residuals silently; a run in a
comparison's folder mixed its files with the comparison's.

What fedgc writes in a ``state_dir`` is listed in its manifest (:data:`MANIFEST`, one file name
a line, appended by each writer the first time it creates a file: :func:`note_written`), and
``overwrite=true`` deletes the listed files only (:func:`remove_written`): never a file fedgc
did not write, whatever its name. The manifest is itself data anyone could have written, so it
is honoured only as fedgc writes it: a regular file (never a link), of at most
:data:`MAX_MANIFEST_BYTES`, whose lines count only where they name a regular file by a name
fedgc's writers give (:data:`WRITTEN_NAME`); a line naming ``thesis.tex`` deletes nothing.
"""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["KINDS", "MANIFEST", "MARK", "MAX_MANIFEST_BYTES", "WRITTEN_NAME", "Owner",
           "OwnershipError", "claim", "new_run_id", "note_written", "owner_of", "remove_written",
           "written"]

#: The mark's file name, in the folder it marks.
MARK = ".fedgc-owner.json"
#: The manifest's file name: the names of the files fedgc wrote in the folder, one a line.
MANIFEST = ".fedgc-written"
#: What a mark says a folder is: a run's results, a comparison's, or a run's client state.
KINDS = ("run", "compare", "state_dir")
_MAX_MARK_BYTES = 64 * 1024
#: The most bytes of a manifest read: the names of a million client records (``<key>.state``,
#: 13 bytes a line for a six-digit key) take 13 MB.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: The names fedgc's writers give the files a manifest lists: the client state store's records,
#: ``<key>.state`` (client keys as ``client.state`` allows them), and the damaged ones it set
#: aside, ``<key>.state.corrupt-<n>``; and the two files of a study's colluding clients
#: (``client/collusion.py``: ``collusion.knowledge`` and its lock, ``collusion.lock``). No other
#: name in a manifest is fedgc's.
WRITTEN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\.state(?:\.corrupt-[0-9]{1,9})?"
                          r"|collusion\.(?:knowledge|lock)")
_NOUN = {"run": "the results folder of run", "compare": "the folder of the comparison",
         "state_dir": "the client state folder of run"}


class OwnershipError(ValueError):
    """A folder belongs to another run or comparison, or its mark is damaged."""


@dataclass(frozen=True)
class Owner:
    """Who a folder belongs to.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    run_id : str
        The run's (or comparison's) id, :func:`new_run_id`; a run keeps it when resumed or
        overwritten, and marks its ``state_dir`` with it.
    folder : str
        The run's (or comparison's) results folder when it was marked, to name it in messages.
    """

    kind: str
    run_id: str
    folder: str

    def describe(self) -> str:
        """``the client state folder of run results/x`` and the like."""
        return f"{_NOUN.get(self.kind, self.kind)} {self.folder}"


def new_run_id() -> str:
    """A fresh id for a run or comparison (random: two runs never share one)."""
    return uuid.uuid4().hex


def owner_of(folder: Path) -> Owner | None:
    """The owner ``folder``'s mark names, or None when it has no mark.

    Raises
    ------
    OwnershipError
        The mark is not a regular file, too large, or not a mark (naming it).
    """
    path = Path(folder) / MARK
    try:
        info = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARK_BYTES:
        raise OwnershipError(f"{path} is not a fedgc ownership mark (a regular file under "
                             f"{_MAX_MARK_BYTES} bytes); remove it or choose another folder")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        owner = Owner(**{k: data[k] for k in ("kind", "run_id", "folder")})
    except (OSError, ValueError, KeyError, TypeError) as ex:
        raise OwnershipError(f"{path} is a damaged fedgc ownership mark ({ex}); remove it or "
                             f"choose another folder") from None
    if owner.kind not in KINDS or not all(isinstance(v, str) for v in asdict(owner).values()):
        raise OwnershipError(f"{path} is a damaged fedgc ownership mark (kind {owner.kind!r})")
    return owner


def claim(folder: Path, owner: Owner) -> bool:
    """Mark the existing ``folder`` as ``owner``'s; True when this call wrote the mark.

    Raises
    ------
    OwnershipError
        ``folder`` is marked as another owner's (kind or run id), naming it.
    """
    path = Path(folder) / MARK
    text = json.dumps(asdict(owner), sort_keys=True) + "\n"
    try:
        # O_EXCL: of two processes claiming at once, one writes and the other reads its mark.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        theirs = owner_of(folder)
        if theirs is not None and (theirs.kind, theirs.run_id) == (owner.kind, owner.run_id):
            return False
        raise OwnershipError(f"{folder} is {theirs.describe() if theirs else 'marked'}; "
                             f"it cannot also be {owner.describe()}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return True


def note_written(folder: Path, name: str) -> None:
    """Add ``name`` (a file fedgc is about to create in ``folder``) to the folder's manifest.

    One short append (``O_APPEND``): appends of concurrent writers on one machine do not mix
    (on a network filesystem they may be lost, which leaves a file :func:`remove_written` does
    not delete, never one it deletes wrongly).
    """
    if not WRITTEN_NAME.fullmatch(name) or name in (".", ".."):
        raise OwnershipError(f"{name!r} is not a file name a manifest may list (fedgc's "
                             f"writers': {WRITTEN_NAME.pattern})")
    fd = os.open(Path(folder) / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{name}\n".encode())
    finally:
        os.close(fd)


def written(folder: Path) -> list[str]:
    """The file names ``folder``'s manifest lists that fedgc's writers give (sorted, once each;
    none without a manifest).

    Raises
    ------
    OwnershipError
        The manifest is a link or not a regular file, or larger than
        :data:`MAX_MANIFEST_BYTES` (naming it): read with ``lstat``, it is not read at all.
    """
    path = Path(folder) / MANIFEST
    try:
        info = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return []
    if not stat.S_ISREG(info.st_mode):
        raise OwnershipError(f"{path} is not fedgc's manifest (a link or not a regular file); "
                             f"remove it or choose another folder")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise OwnershipError(f"{path} holds {info.st_size} bytes, more than fedgc's manifest "
                             f"of {MAX_MANIFEST_BYTES}; remove it or choose another folder")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read(MAX_MANIFEST_BYTES + 1).decode("utf-8", errors="replace")
    except OSError as ex:
        raise OwnershipError(f"{path} cannot be read ({ex.strerror or ex}); remove it or "
                             f"choose another folder") from None
    return sorted({line for line in text.splitlines() if WRITTEN_NAME.fullmatch(line)})


def remove_written(folder: Path) -> list[str]:
    """Delete the files ``folder``'s manifest lists (:func:`written`: fedgc's names; regular
    files only, never a link) and the temporary files a crash left while writing them
    (``.<name>.<8 characters>.tmp``, what :func:`fedgc.files.atomic_write` makes), then the
    manifest; return the names deleted. Nothing else in the folder is touched.

    Raises
    ------
    OwnershipError
        The manifest is not fedgc's (:func:`written`); nothing is deleted.
    """
    if not Path(folder).is_dir():
        return []
    listed = written(folder)
    temporary = re.compile(r"^\.(" + "|".join(map(re.escape, listed)) + r")\.[a-z0-9_]{8}\.tmp$")
    removed = []
    leftovers = [p.name for p in Path(folder).iterdir() if listed and temporary.match(p.name)]
    for name in [*listed, *leftovers]:
        path = Path(folder) / name
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                continue  # fedgc's writers list regular files only: a folder or link is not
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
    (Path(folder) / MANIFEST).unlink(missing_ok=True)
    return removed
