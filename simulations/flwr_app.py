"""The project's Flower app staged: the files ``flwr run`` bundles, copied to a folder of their own.

``flwr run PROJECT`` collects every file under the folder before it filters them
(``flwr.cli.utils.collect_files``, then ``filter_paths_for_publish``), and resolves each path on
the way: with a virtualenv in the checkout that is 60,000 files and 12-16 s of CPU before every
run, for about 430 files kept. :func:`app_files` applies the same rules without resolving each
file, and :func:`staged_app` copies the files kept to a temporary folder that ``flwr run`` bundles
instead: the same files, the same bytes, so the same FAB (``tests/test_flwr_app.py`` compares
both with Flower's own functions).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _collect(root: Path) -> list[str]:
    """Every file under ``root`` by its relative POSIX path, by the rules of Flower's
    ``collect_files``: links (to files or folders) are left out and linked folders not entered;
    an unreadable folder is passed over (``os.walk``'s default).

    Flower also drops a path that resolves outside ``root``; a path with no link in it below
    ``root`` cannot, so it is not resolved here (the resolving is what costs the time)."""
    files: list[str] = []
    pending = [(str(root), "")]
    while pending:
        folder, prefix = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_dir(follow_symlinks=False):
                pending.append((entry.path, f"{prefix}{entry.name}/"))
            else:
                files.append(f"{prefix}{entry.name}")
    return files


def app_files(project: Path) -> dict[str, Path]:
    """The files of ``project`` that ``flwr run project`` bundles, by relative POSIX path.

    Flower's own filter decides (``filter_paths_for_publish``: its include and exclude
    patterns, then the project's ``.gitignore``).

    Raises
    ------
    flwr.cli.utils.AppPathDepthError
        A file kept lies deeper than Flower allows (``flwr run`` refuses the app for it too).
    """
    from flwr.cli.utils import filter_paths_for_publish

    root = project.expanduser().resolve()
    # The filter reads only .gitignore's content; the other 60,000 need no Path of their own.
    found: dict[str, Path | bytes] = dict.fromkeys(_collect(root), b"")
    if ".gitignore" in found:
        found[".gitignore"] = root / ".gitignore"
    return {relative: root / relative for relative in sorted(filter_paths_for_publish(found))}


@contextmanager
def staged_app(project: Path) -> Iterator[Path]:
    """A temporary folder holding a copy of :func:`app_files` of ``project``, removed (with
    whatever was written into it) when the block ends."""
    with tempfile.TemporaryDirectory(prefix="fedgc-flwr-app-") as folder:
        yield stage_app(project, Path(folder))


def stage_app(project: Path, into: Path) -> Path:
    """Copy :func:`app_files` of ``project`` into the folder ``into`` (created if missing; a
    file of the same name there is replaced) and return ``into``."""
    for relative, source in app_files(project).items():
        target = into / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return into
