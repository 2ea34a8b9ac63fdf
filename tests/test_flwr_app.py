"""The staged app of ``python -m simulations flwr`` (``simulations/flwr_app.py``): the files, and
so the FAB, that Flower's ``flwr run`` bundles from the project folder itself."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk, build_fab_from_files
from flwr.cli.utils import AppPathDepthError, collect_files, filter_paths_for_publish

from simulations.flwr_app import app_files, stage_app, staged_app

ROOT = Path(__file__).resolve().parents[1]


def _flowers_own(project: Path) -> dict[str, Path]:
    """What ``flwr run project`` bundles, by Flower's own functions (build_fab_from_disk)."""
    root = project.resolve()
    return {k: Path(v) for k, v in filter_paths_for_publish(collect_files(root)).items()}


def _project(tmp_path: Path, gitignore_linked: bool) -> Path:
    """A project with what Flower's rules tell apart: files it keeps and patterns it drops, a
    virtualenv, caches, an ignored folder, links to files and folders, a broken link."""
    project = tmp_path / "project"
    files = {"pyproject.toml": (ROOT / "pyproject.toml").read_bytes(),
             "server/app.py": b"app = 1\n", "docs/guide.md": b"# guide\n",
             "data/table.json": b"{}\n", "data/weights.bin": b"\0\1",
             "notes.txt": b"not bundled\n", "LICENSE": b"licence\n",
             ".venv/lib/site.py": b"x = 1\n", "sub/.venv/keep.py": b"x = 2\n",
             "server/__pycache__/app.py": b"cache\n", ".flwr/config.toml": b"a = 1\n",
             "results/run/summary.json": b"{}\n", "build/lib/mod.py": b"y = 1\n",
             "run.log.py": b"z = 1\n"}
    for name, content in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_bytes(content)
    gitignore = b"results/\nbuild/\n*.log.py\n"
    if gitignore_linked:  # Flower skips a linked .gitignore, and so its patterns
        (tmp_path / "ignore").write_bytes(gitignore)
        (project / ".gitignore").symlink_to(tmp_path / "ignore")
    else:
        (project / ".gitignore").write_bytes(gitignore)
    (project / "linked.py").symlink_to(project / "server" / "app.py")
    (project / "linked_folder").symlink_to(project / "server", target_is_directory=True)
    (project / "outside").symlink_to(tmp_path, target_is_directory=True)
    (project / "broken.py").symlink_to(project / "missing.py")
    return project


@pytest.mark.parametrize("gitignore_linked", [False, True], ids=["gitignore", "linked-gitignore"])
def test_the_staged_app_holds_the_files_and_fab_flower_bundles(tmp_path, gitignore_linked):
    project = _project(tmp_path, gitignore_linked)
    expected = _flowers_own(project)
    assert app_files(project) == expected
    assert "server/app.py" in expected and "sub/.venv/keep.py" in expected  # kept, and
    assert ("results/run/summary.json" in expected) is gitignore_linked  # .gitignore's say

    staged = stage_app(project, tmp_path / "staged")
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*")
                  if p.is_file()) == sorted(expected)
    assert build_fab_from_disk(staged) == build_fab_from_disk(project)


def test_the_projects_staged_fab_is_the_one_flwr_run_builds_from_the_folder(tmp_path):
    """On the checkout itself, its virtualenv included: the files and the FAB's digest that
    `flwr run .` gets from the folder (Flower's own walk of it: several seconds of CPU)."""
    collected = collect_files(ROOT)  # build_fab_from_disk(ROOT), walked once
    expected = {k: Path(v) for k, v in filter_paths_for_publish(collected).items()}
    assert app_files(ROOT) == expected and "pyproject.toml" in expected
    staged = stage_app(ROOT, tmp_path / "staged")
    digest = hashlib.sha256(build_fab_from_disk(staged)).hexdigest()
    assert digest == hashlib.sha256(build_fab_from_files(collected)[0]).hexdigest()


def test_the_temporary_stage_is_removed_with_what_was_written_into_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    project = _project(tmp_path, gitignore_linked=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    with staged_app(project) as app:
        assert app.parent == tmp_path / "tmp" and (app / "server" / "app.py").is_file()
        (app / "written_by_flwr").mkdir()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert (project / "server" / "app.py").read_bytes() == b"app = 1\n"  # the project kept


def test_an_app_deeper_than_flower_allows_is_refused_in_one_line_before_anything_starts(
        tmp_path, monkeypatch, capsys):
    from simulations import flwr_run
    from simulations.cli import main

    project = _project(tmp_path, gitignore_linked=False)
    deep = project.joinpath(*[f"d{i}" for i in range(11)], "deep.py")
    deep.parent.mkdir(parents=True)
    deep.write_bytes(b"")
    with pytest.raises(AppPathDepthError):
        filter_paths_for_publish(collect_files(project))  # Flower refuses it too
    with pytest.raises(AppPathDepthError):
        app_files(project)

    def started(*args, **kwargs):
        raise AssertionError("nothing may start for an app Flower refuses")

    monkeypatch.setattr(flwr_run, "PROJECT", project)
    monkeypatch.setattr(flwr_run.subprocess, "Popen", started)
    results = tmp_path / "results"
    assert main(["flwr", "--set", "task=digits", "--set", f"results_dir={results}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "d0/d1/d2/d3/d4/d5/d6/d7/d8/d9/d10/deep.py" in err[0], err
    assert not results.exists()
