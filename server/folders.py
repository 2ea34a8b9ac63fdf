"""A run's folders before round 1: who owns the results folder and the ``state_dir``, what
``overwrite=true`` deletes there, and creating them once every check has passed.

A results folder belongs to one run or one comparison, a ``state_dir`` to one run, as their
marks say (:mod:`fedgc.ownership`); another is refused, naming the owner. Only the mark says a
folder is fedgc's: a folder without one holding files named as a run's (``checkpoint.pt``,
``rounds.csv``) is not replaced, whatever their names (an earlier fedgc's run there can be
resumed, which marks it). :func:`plan_folders` only reads; :func:`make_folders` takes the run
folder's lock (:class:`RunLock`: one process runs in a run folder at a time), deletes what an
overwrite replaces, creates and marks the folders, and takes back what it created when a step
fails, so that a refused run leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgc.ownership import (
    MANIFEST,
    MARK,
    Owner,
    OwnershipError,
    claim,
    new_run_id,
    owner_of,
    remove_written,
    written,
)
from server.checkpoint import CHECKPOINT_FILE
from server.preflight import PreflightError, check_writable
from server.tensorboard import clear_events

#: The files of a run that ``overwrite=true`` replaces in its results folder (with the
#: TensorBoard event files); fedgc's own names, deleted only in a folder marked as the run's.
RUN_FILES = (CHECKPOINT_FILE, "rounds.csv", "clients.csv", "summary.json")
#: What a comparison writes in its own folder, besides its runs' folders.
COMPARE_FILES = ("compare.json", "compare.png", "accuracy_vs_traffic.png")
#: A client's record as the store names it (integer client keys), current or legacy: one
#: such file that the manifest does not list stops an overwrite (it would leak a residual).
_RECORD = re.compile(r"^\d{1,19}\.(?:state|pt)$")
#: The run folder's lock file (:class:`RunLock`), fedgc's like the mark.
LOCK = ".fedgc-lock"


class RunFolderError(RuntimeError):
    """The run folder holds an earlier run (and neither ``resume`` nor ``overwrite`` is set),
    belongs to another run or a comparison, cannot be created or written, or ``overwrite``
    cannot replace the earlier run without deleting what fedgc did not write."""


@dataclass(frozen=True)
class FolderPlan:
    """What :func:`plan_folders` found: the run's id, and whether an earlier run is replaced."""

    run_id: str
    replace: bool


def _entries(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.name not in (MARK, MANIFEST, LOCK))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds what a run writes first (a checkpoint or ``rounds.csv``): a
    run's results in a folder fedgc marked, files of those names in another (whose they are,
    the mark says: :func:`plan_folders`)."""
    return bool(_run_files(folder))


def _run_files(folder: Path) -> list[str]:
    """The names of :data:`RUN_FILES` in ``folder``, links included (``lstat``)."""
    found = []
    for name in RUN_FILES:
        try:
            (folder / name).lstat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append(name)
    return found if set(found) & {CHECKPOINT_FILE, "rounds.csv"} else []


def plan_folders(config: Any) -> FolderPlan:
    """Check, reading only, that the run may use its results folder and ``state_dir``.

    Raises
    ------
    RunFolderError
        The results folder belongs to a comparison or to something else than this run, holds
        an earlier run without ``resume`` or ``overwrite``, or holds files fedgc did not write.
    server.preflight.PreflightError
        The ``state_dir`` belongs to another run, or holds files and no run's mark.
    """
    run_dir, s = config.run_dir, config.server
    if (run_dir.exists() or run_dir.is_symlink()) and not run_dir.is_dir():
        raise RunFolderError(f"run folder {run_dir} is not a folder (results_dir="
                             f"{s.results_dir!r}, run_name={s.run_name!r})")
    try:
        owner = owner_of(run_dir)
    except OwnershipError as ex:
        raise RunFolderError(str(ex)) from None
    has_run = holds_run(run_dir)
    if owner is not None and owner.kind != "run":
        raise RunFolderError(f"{run_dir} is {owner.describe()}: a run cannot share it; choose "
                             f"another run_name")
    if owner is None and not has_run and (foreign := _entries(run_dir)):
        what = ("a comparison's files" if any((run_dir / n).is_dir() and holds_run(run_dir / n)
                                              for n in foreign) or "compare.json" in foreign
                else "files fedgc did not write")
        raise RunFolderError(f"run folder {run_dir} already holds {what} ({_listing(foreign)}); "
                             f"a run folder belongs to one run: choose another run_name")
    if has_run and owner is None and not s.resume:
        # Files named as a run's, in a folder fedgc did not mark: the user's (or an earlier
        # fedgc's, which resume=true continues and marks). Nothing is deleted on a name.
        raise RunFolderError(
            f"run folder {run_dir} holds {_listing(_run_files(run_dir))} and no fedgc mark "
            f"({MARK}): fedgc replaces only a run it marked, and deletes nothing of a folder it "
            f"did not; move those files away or choose another run_name (resume=true continues "
            f"a run an earlier fedgc wrote there)")
    if has_run and not (s.resume or s.overwrite):
        raise RunFolderError(f"{run_dir} already holds a run; set resume=true to continue it, "
                             f"overwrite=true to replace it, or choose another run_name")
    run_id = owner.run_id if owner is not None else new_run_id()
    replace = has_run and s.overwrite and not s.resume
    _plan_state_dir(config, run_id, replace)
    return FolderPlan(run_id, replace)


def _plan_state_dir(config: Any, run_id: str, replace: bool) -> None:
    folder, run_dir = config.state_dir, config.run_dir
    try:
        owner = owner_of(folder)
    except OwnershipError as ex:
        raise PreflightError(f"state_dir: {ex}") from None
    if owner is not None and (owner.kind, owner.run_id) != ("state_dir", run_id):
        raise PreflightError(
            f"state_dir {folder} is {owner.describe()}: a state_dir holds one run's client state "
            f"(two runs in one folder mix their residuals); choose another state_dir, or resume "
            f"that run")
    entries = _entries(folder)
    if owner is None and entries and not config.server.resume:
        # Unmarked: the user's, or written before fedgc marked its folders (a resume of such a
        # run may use it). A new run starts from an empty folder.
        raise PreflightError(
            f"state_dir {folder} holds {len(entries)} "
            f"entr{'y' if len(entries) == 1 else 'ies'} and no run's mark "
            f"({_listing(entries)}); a new run keeps its client state in an empty folder "
            f"(fedgc deletes only what it listed there): choose another state_dir or empty it")
    if replace:
        try:
            listed = set(written(folder))
        except OwnershipError as ex:
            raise PreflightError(f"overwrite=true, state_dir: {ex}") from None
        stray = [n for n in entries if _RECORD.match(n) and n not in listed]
        if stray:
            raise PreflightError(
                f"overwrite=true would leave client records in state_dir {folder} that its "
                f"manifest does not list ({_listing(stray)}), and the new run would read them; "
                f"fedgc deletes only what it listed: remove them, or choose another state_dir "
                f"(run folder {run_dir})")


class RunLock:
    """The lock of one run folder: an exclusive ``flock`` on its :data:`LOCK` file, which the
    process running there holds until :meth:`release`, or until it exits (the kernel releases
    the lock of a process that crashed or was killed). Two ``resume=true`` of one run, or an
    ``overwrite=true`` while it runs, would otherwise both write its checkpoint and results.

    The file holds the holder's pid and start time, to name it in the refusal; it stays in the
    folder (removing a lock file races with the next process to open it).
    """

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise RunFolderError naming its holder (or OSError when the lock
        file cannot be opened)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RunFolderError(f"{self.path} is not fedgc's lock file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
                raise RunFolderError(
                    f"run folder {self.path.parent} is in use by another fedgc process "
                    f"({holder}): one run at a time in a run folder; wait for it to end, or "
                    f"choose another run_name") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      .encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let the next process run in the folder (nothing when not held)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def make_folders(config: Any, plan: FolderPlan) -> RunLock:
    """Take the run folder's lock, replace an earlier run (``plan.replace``), create, mark and
    check the results folder and the ``state_dir``; what this call created is removed again
    when a step fails. Returns the lock, which the caller holds while the run runs.

    Raises
    ------
    RunFolderError
        The results folder cannot be created, marked or written, or another process runs in
        it (:class:`RunLock`).
    server.preflight.PreflightError
        The ``state_dir`` cannot be created, marked or written.
    """
    run_dir, s = config.run_dir, config.server
    created: list[Path] = []
    marked: list[Path] = []
    owner = Owner("run", plan.run_id, str(run_dir))
    lock = RunLock(run_dir)
    try:
        try:
            created += _mkdir(run_dir)
            lock.acquire()
            if claim(run_dir, owner):
                marked.append(run_dir)
            check_writable(run_dir, "run folder", "results are written there")
        except (OSError, OwnershipError, PreflightError) as ex:
            why = ex.strerror if isinstance(ex, OSError) and ex.strerror else ex
            raise RunFolderError(f"run folder {run_dir}: {why} (results_dir={s.results_dir!r}, "
                                 f"run_name={s.run_name!r})") from ex
        folder = config.state_dir
        try:
            created += _mkdir(folder)
            if claim(folder, Owner("state_dir", plan.run_id, str(run_dir))):
                marked.append(folder)
        except (OSError, OwnershipError) as ex:
            why = ex.strerror if isinstance(ex, OSError) and ex.strerror else ex
            raise PreflightError(f"state_dir {folder} is not a writable folder ({why}); clients "
                                 f"keep their residuals there") from ex
        check_writable(folder, "state_dir", "clients keep their residuals there")
        if plan.replace:
            # Residuals of the replaced run must not leak into the new one. The manifest was
            # checked by plan_folders; one changed since refuses here, before anything goes.
            try:
                remove_written(config.state_dir)
            except OwnershipError as ex:
                raise PreflightError(f"overwrite=true, state_dir: {ex}") from None
    except BaseException:
        for path in marked:
            (path / MARK).unlink(missing_ok=True)
        if lock.held and run_dir in created:
            (run_dir / LOCK).unlink(missing_ok=True)
        lock.release()
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass
        raise
    if plan.replace:
        for name in RUN_FILES:
            path = run_dir / name
            try:
                if stat.S_ISREG(path.lstat().st_mode):  # fedgc writes regular files only
                    path.unlink()
            except FileNotFoundError:
                continue
        clear_events(run_dir)
    return lock


def _mkdir(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those this call created, outermost
    first."""
    missing = []
    current = Path(folder)
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    made = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue  # another process made it at the same moment: not ours to remove
        made.append(path)
    return made


# ------------------------------------------------------------------ comparisons


def check_compare_folder(folder: Path) -> str:
    """The id of the comparison that may write in ``folder``: its mark's, or a new one for a
    missing or empty folder, or an unmarked earlier comparison's (reading only).

    Raises
    ------
    RunFolderError
        ``folder`` is a run's (or state) folder, holds a run, or holds files fedgc did not
        write, naming it.
    """
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise RunFolderError(f"comparison folder {folder} is not a folder")
    try:
        owner = owner_of(folder)
    except OwnershipError as ex:
        raise RunFolderError(str(ex)) from None
    if owner is not None and owner.kind != "compare":
        raise RunFolderError(f"{folder} is {owner.describe()}: a comparison cannot share it; "
                             f"choose another run_name")
    if owner is None and holds_run(folder):
        raise RunFolderError(f"{folder} holds a run: a comparison cannot share its folder; "
                             f"choose another run_name")
    foreign = [n for n in _entries(folder)
               if n not in COMPARE_FILES and not (folder / n).is_dir()]
    if owner is None and foreign:
        raise RunFolderError(f"{folder} already holds files fedgc did not write "
                             f"({_listing(foreign)}); a comparison's folder belongs to it: "
                             f"choose another run_name")
    return owner.run_id if owner is not None else new_run_id()


def claim_compare_folder(folder: Path, compare_id: str) -> None:
    """Create ``folder`` and mark it as the comparison ``compare_id``'s."""
    try:
        _mkdir(folder)
        claim(folder, Owner("compare", compare_id, str(folder)))
    except (OSError, OwnershipError) as ex:
        why = ex.strerror if isinstance(ex, OSError) and ex.strerror else ex
        raise RunFolderError(f"comparison folder {folder}: {why}") from ex
