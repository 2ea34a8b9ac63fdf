"""A run's folders before round 1: who owns the results folder and the ``state_dir``, what
``overwrite=true`` deletes there, and creating them once every check has passed.

A results folder belongs to one run or one comparison, a ``state_dir`` to one run, as their
marks say (:mod:`fedgc.ownership`); another is refused, naming the owner. :func:`plan_folders`
only reads; :func:`make_folders` deletes what an overwrite replaces, creates and marks the
folders, and takes back what it created when a step fails, so that a refused run leaves
nothing behind.
"""

from __future__ import annotations

import re
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
#: TensorBoard event files); fedgc's own names, in a folder marked as the run's.
RUN_FILES = (CHECKPOINT_FILE, "rounds.csv", "clients.csv", "summary.json")
#: What a comparison writes in its own folder, besides its runs' folders.
COMPARE_FILES = ("compare.json", "compare.png", "accuracy_vs_traffic.png")
#: A client's record as the store names it (integer client keys), current or legacy: one
#: such file that the manifest does not list stops an overwrite (it would leak a residual).
_RECORD = re.compile(r"^\d{1,19}\.(?:state|pt)$")
#: What the client store of a fedgc that kept no manifest wrote: ``<key>.state``, legacy
#: ``<key>.pt``, ``<key>.state.corrupt-<n>`` and its temporary ``.<key>.state.<8>.tmp`` files,
#: integer client keys; deleted only in the default state folder of such a run, replaced.
_LEGACY_STATE_FILE = re.compile(r"^(?:\d{1,19}\.(?:state|pt)(?:\.corrupt-\d{1,9})?"
                                r"|\.\d{1,19}\.(?:state|pt)\.[a-z0-9_]{8}\.tmp)$")
#: The state folder of a run without ``state_dir``, inside its run folder
#: (``fedgc.settings.RunConfig.state_dir``).
DEFAULT_STATE_DIR = "client_state"


class RunFolderError(RuntimeError):
    """The run folder holds an earlier run (and neither ``resume`` nor ``overwrite`` is set),
    belongs to another run or a comparison, cannot be created or written, or ``overwrite``
    cannot replace the earlier run without deleting what fedgc did not write."""


@dataclass(frozen=True)
class FolderPlan:
    """What :func:`plan_folders` found: the run's id, and whether an earlier run is replaced."""

    run_id: str
    replace: bool
    legacy_state: bool = False  # replacing a run of a fedgc that marked no folder


def _entries(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.name not in (MARK, MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run's results (a checkpoint or ``rounds.csv``)."""
    return (folder / CHECKPOINT_FILE).exists() or (folder / "rounds.csv").exists()


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
    if has_run and not (s.resume or s.overwrite):
        raise RunFolderError(f"{run_dir} already holds a run; set resume=true to continue it, "
                             f"overwrite=true to replace it, or choose another run_name")
    run_id = owner.run_id if owner is not None else new_run_id()
    replace = has_run and s.overwrite and not s.resume
    _plan_state_dir(config, run_id, replace)
    legacy = replace and owner is None and config.state_dir == run_dir / DEFAULT_STATE_DIR
    return FolderPlan(run_id, replace, legacy)


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
    if owner is None and replace and folder == run_dir / DEFAULT_STATE_DIR:
        # A run written before fedgc marked its folders, replaced in place: its own client
        # state folder, inside its run folder, holds the store's files (integer client keys)
        # and perhaps others, which stay.
        return
    if owner is None and entries and not config.server.resume:
        # Unmarked: the user's, or written before fedgc marked its folders (a resume of such a
        # run may use it). A new run starts from an empty folder.
        raise PreflightError(
            f"state_dir {folder} holds {len(entries)} "
            f"entr{'y' if len(entries) == 1 else 'ies'} and no run's mark "
            f"({_listing(entries)}); a new run keeps its client state in an empty folder "
            f"(fedgc deletes only what it listed there): choose another state_dir or empty it")
    if replace:
        listed = set(written(folder))
        stray = [n for n in entries if _RECORD.match(n) and n not in listed]
        if stray:
            raise PreflightError(
                f"overwrite=true would leave client records in state_dir {folder} that its "
                f"manifest does not list ({_listing(stray)}), and the new run would read them; "
                f"fedgc deletes only what it listed: remove them, or choose another state_dir "
                f"(run folder {run_dir})")


def make_folders(config: Any, plan: FolderPlan) -> None:
    """Replace an earlier run (``plan.replace``), then create, mark and check the results folder
    and the ``state_dir``; what this call created is removed again when a step fails.

    Raises
    ------
    RunFolderError
        The results folder cannot be created, marked or written.
    server.preflight.PreflightError
        The ``state_dir`` cannot be created, marked or written.
    """
    run_dir, s = config.run_dir, config.server
    created: list[Path] = []
    marked: list[Path] = []
    owner = Owner("run", plan.run_id, str(run_dir))
    try:
        try:
            created += _mkdir(run_dir)
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
    except BaseException:
        for path in marked:
            (path / MARK).unlink(missing_ok=True)
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass
        raise
    if plan.replace:
        # Residuals of the replaced run must not leak into the new one.
        remove_written(config.state_dir)
        if plan.legacy_state:
            for path in config.state_dir.iterdir():
                if _LEGACY_STATE_FILE.match(path.name) and path.is_file():
                    path.unlink()
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        clear_events(run_dir)


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
