"""A folder belongs to one run or comparison (issues 26 and 27): a ``state_dir`` is refused to a
second run, a run's folder to a comparison and the reverse, each naming the owner; a run the
checks refuse leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedgc.ownership import (
    MARK,
    Owner,
    OwnershipError,
    claim,
    note_written,
    owner_of,
    remove_written,
    written,
)
from simulations.cli import main

BASE = ["--set", "task=digits", "--set", "num_clients=4", "--set", "clients_per_round=2",
        "--set", "rounds=1", "--set", "sim.engine=local", "--set", "progress=false",
        "--set", "partition=iid"]


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


def test_a_state_dir_belongs_to_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    """Issue 26 item 5: run A, run B on A's state_dir, resume A: 0.59 instead of 0.735, silently.
    B is now refused, naming A, and A resumes on its own state."""
    state = tmp_path / "shared-state"
    common = [*BASE, "--set", f"results_dir={tmp_path}", "--set", f"state_dir={state}"]
    assert _main(["run", *common, "--set", "run_name=a"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in state.glob("*.state")}
    code, err = _main(["run", *common, "--set", "run_name=b"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"state_dir {state} is the client state folder of run {tmp_path / 'a'}" in err
    assert {p.name: p.read_bytes() for p in state.glob("*.state")} == before
    assert not (tmp_path / "b").exists()  # nothing of the refused run is left
    code, err = _main(["run", *common, "--set", "run_name=a", "--set", "rounds=2",
                       "--set", "resume=true"], capsys)
    assert code == 0, err
    # A folder fedgc did not mark, holding files, is no new run's state_dir either.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "3.state").write_text("someone's")
    code, err = _main(["run", *BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=c",
                       "--set", f"state_dir={theirs}"], capsys)
    assert code == 2 and "holds 1 entry and no run's mark (3.state)" in err
    assert (theirs / "3.state").read_text() == "someone's"


def test_a_run_and_a_comparison_never_share_a_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27: `run --set run_name=quick` wrote into an earlier comparison's folder, and
    `compare` mixed into a run's folder."""
    common = [*BASE, "--set", f"results_dir={tmp_path}"]
    assert _main(["compare", "--methods", "dense", *common, "--set", "run_name=cmp"],
                 capsys)[0] == 0
    assert owner_of(tmp_path / "cmp").kind == "compare"
    assert owner_of(tmp_path / "cmp" / "dense").kind == "run"
    listing = sorted(p.name for p in (tmp_path / "cmp").iterdir())
    for extra in ([], ["--set", "overwrite=true"]):
        code, err = _main(["run", *common, "--set", "run_name=cmp", *extra], capsys)
        assert code == 2 and f"{tmp_path / 'cmp'} is the folder of the comparison" in err
        assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == listing
    # The comparison again, replacing its own runs: its folder, so it may.
    assert _main(["compare", "--methods", "dense", *common, "--set", "run_name=cmp",
                  "--set", "overwrite=true"], capsys)[0] == 0

    assert _main(["run", *common, "--set", "run_name=one"], capsys)[0] == 0
    code, err = _main(["compare", "--methods", "dense", *common, "--set", "run_name=one"],
                      capsys)
    assert code == 2 and f"{tmp_path / 'one'} is the results folder of run" in err
    assert not (tmp_path / "one" / "dense").exists()
    # A folder of the user's own is neither's.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for command in (["run"], ["compare", "--methods", "dense"]):
        code, err = _main([*command, *common, "--set", "run_name=mine"], capsys)
        assert code == 2 and "holds files fedgc did not write (notes.txt)" in err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("command", [["run"], ["compare", "--methods", "dense"]])
def test_a_run_refused_by_its_checks_leaves_nothing_behind(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """Issue 27: `task=mnist` without data_dir left an empty results folder."""
    results = tmp_path / "results"
    code, err = _main([*command, *BASE, "--set", f"results_dir={results}", "--set", "task=mnist",
                       "--set", "run_name=r"], capsys)
    assert code == 2 and "data_dir" in err
    assert not results.exists()
    if command != ["run"]:
        return  # a comparison's runs keep their state in their own folders (state_dir ignored)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = _main([*command, *BASE, "--set", f"results_dir={results}",
                       "--set", f"state_dir={blocker / 's'}", "--set", "run_name=r"], capsys)
    assert code == 2 and f"state_dir {blocker / 's'} is not a writable folder" in err
    assert not results.exists()  # the run folder made before the state_dir failed is gone


def test_marks_and_manifests(tmp_path: Path) -> None:
    run = Owner("run", "id-1", "results/a")
    assert claim(tmp_path, run) and not claim(tmp_path, run)  # idempotent for its owner
    with pytest.raises(OwnershipError, match="is the results folder of run results/a; it "
                                             "cannot also be the folder of the comparison"):
        claim(tmp_path, Owner("compare", "id-2", "results/a"))
    with pytest.raises(OwnershipError, match="cannot also be the results folder"):
        claim(tmp_path, Owner("run", "id-3", "results/a"))
    (tmp_path / MARK).write_text(json.dumps({"kind": "boss"}))
    with pytest.raises(OwnershipError, match="damaged fedgc ownership mark"):
        owner_of(tmp_path)
    state = tmp_path / "s"
    state.mkdir()
    for name in ("1.state", "2.state"):
        note_written(state, name)
        (state / name).write_text("x")
    note_written(state, "never-made.state")
    (state / "3.state").write_text("not listed")
    (state / "ours").mkdir()
    note_written(state, "ours")  # a folder where a listed file was: left alone
    for bad in ("../x", "a/b", MARK):
        with pytest.raises(OwnershipError):
            note_written(state, bad)
    # What a crash leaves while writing a listed file goes with it; look-alikes stay.
    for name in (".1.state.ab_4k9z0.tmp", ".1.state.notes.tmp", ".3.state.ab_4k9z0.tmp"):
        (state / name).write_text("x")
    assert written(state) == ["1.state", "2.state", "never-made.state", "ours"]
    assert remove_written(state) == ["1.state", "2.state", ".1.state.ab_4k9z0.tmp"]
    assert sorted(p.name for p in state.iterdir()) == [".1.state.notes.tmp",
                                                       ".3.state.ab_4k9z0.tmp", "3.state", "ours"]


def test_a_run_of_a_fedgc_that_marked_nothing_is_replaced_in_its_own_folders(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo` over the results/demo an earlier fedgc wrote: no marks, no manifest."""
    argv = ["run", *BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=old",
            "--set", "method=dgc"]
    assert _main(argv, capsys)[0] == 0
    run, state = tmp_path / "old", tmp_path / "old" / "client_state"
    for folder in (run, state):
        (folder / MARK).unlink()
    (state / ".fedgc-written").unlink()
    (state / "my-notes.txt").write_text("mine")
    (state / ".0.state.x1y2z3w4.tmp").write_text("a crash's")
    assert _main([*argv, "--set", "overwrite=true"], capsys)[0] == 0
    assert (state / "my-notes.txt").read_text() == "mine"
    assert not (state / ".0.state.x1y2z3w4.tmp").exists()
    assert owner_of(run).run_id == owner_of(state).run_id
    # A state_dir of its own choosing, unmarked and not empty, is still refused.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "0.state").write_text("?")
    code, err = _main([*argv, "--set", "overwrite=true", "--set", f"state_dir={other}"], capsys)
    assert code == 2 and "no run's mark" in err and (other / "0.state").read_text() == "?"
