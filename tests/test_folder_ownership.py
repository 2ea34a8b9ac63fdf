"""A folder belongs to one run or comparison (issues 26 and 27): a ``state_dir`` is refused to a
second run, a run's folder to a comparison and the reverse, each naming the owner; a run the
checks refuse leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedgc.ownership import (
    MANIFEST,
    MARK,
    Owner,
    OwnershipError,
    claim,
    note_written,
    owner_of,
    remove_written,
    written,
)
from server.checkpoint import load_checkpoint
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
    (state / "ours.state").mkdir()
    note_written(state, "ours.state")  # a folder where a listed file was: left alone
    (state / "mine.txt").write_text("the user's")
    (state / "link.state").symlink_to(state / "mine.txt")
    note_written(state, "link.state")  # a link where a listed file was: left alone
    for bad in ("../x", "a/b", MARK, MANIFEST, "thesis.tex", "1.state/x", ".."):
        with pytest.raises(OwnershipError):
            note_written(state, bad)
    # A manifest is data: a line naming what fedgc's writers never name deletes nothing.
    with (state / MANIFEST).open("a") as fh:
        fh.write("mine.txt\n../s/mine.txt\n")
    # What a crash leaves while writing a listed file goes with it; look-alikes stay.
    for name in (".1.state.ab_4k9z0.tmp", ".1.state.notes.tmp", ".3.state.ab_4k9z0.tmp"):
        (state / name).write_text("x")
    assert written(state) == ["1.state", "2.state", "link.state", "never-made.state",
                              "ours.state"]
    assert remove_written(state) == ["1.state", "2.state", ".1.state.ab_4k9z0.tmp"]
    assert sorted(p.name for p in state.iterdir()) == [".1.state.notes.tmp",
                                                       ".3.state.ab_4k9z0.tmp", "3.state",
                                                       "link.state", "mine.txt", "ours.state"]
    assert (state / "mine.txt").read_text() == "the user's"


def test_a_manifest_is_read_only_as_fedgc_writes_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: a manifest symlinked to a 200 MB file was read whole (680 MB RSS), ``written()``
    following the link where the mark uses ``lstat``; now a link, or a file above the cap, is
    refused unread, and nothing is deleted."""
    state = tmp_path / "s"
    state.mkdir()
    note_written(state, "1.state")
    (state / "1.state").write_text("x")
    big = tmp_path / "big"
    with big.open("wb") as fh:
        fh.truncate(200 * 1024 * 1024)  # sparse: 200 MB that take no disk
    (state / MANIFEST).unlink()
    (state / MANIFEST).symlink_to(big)
    for call in (written, remove_written):
        with pytest.raises(OwnershipError, match="is not fedgc's manifest"):
            call(state)
    assert (state / "1.state").exists()
    (state / MANIFEST).unlink()
    (state / MANIFEST).write_text("1.state\n" * 10)
    monkeypatch.setattr("fedgc.ownership.MAX_MANIFEST_BYTES", 64)
    with pytest.raises(OwnershipError, match="holds 80 bytes, more than fedgc's manifest of 64"):
        remove_written(state)
    assert (state / "1.state").exists()


def _earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], Path]:
    argv = ["run", *BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=old",
            "--set", "method=dgc"]
    assert _main(argv, capsys)[0] == 0
    return argv, tmp_path / "old"


@pytest.mark.parametrize("theirs", [("checkpoint.pt", "summary.json"),
                                    ("rounds.csv", "clients.csv")])
def test_overwrite_deletes_nothing_in_a_folder_fedgc_did_not_mark(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], theirs: tuple[str, str]) -> None:
    """Issue 35: ``holds_run()`` judged a folder by file names, so ``overwrite=true`` on a
    user's folder holding their own ``checkpoint.pt`` deleted it with ``summary.json``; one
    holding ``rounds.csv`` lost it and ``clients.csv``. Only fedgc's mark makes a folder a run's
    to replace."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in theirs:
        (mine / name).write_text(f"my own {name}")
    for extra in ([], ["--set", "overwrite=true"]):
        code, err = _main(["run", *BASE, "--set", f"results_dir={tmp_path}",
                           "--set", "run_name=mine", *extra], capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"run folder {mine} holds {theirs[0]}" in err and "no fedgc mark" in err
    assert sorted(p.name for p in mine.iterdir()) == sorted(theirs)
    assert all((mine / n).read_text() == f"my own {n}" for n in theirs)


def test_a_run_of_a_fedgc_that_marked_nothing_is_resumed_not_replaced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo` over the results/demo an earlier fedgc wrote (no marks, no manifest): its
    files are named as fedgc names them, but no mark says they are fedgc's, so overwrite=true
    deletes none of them (issue 35); resume=true continues it and marks it. Its client records
    stay unlisted (named as fedgc names them, still not known to be its own): overwrite=true
    refuses to leave them to the new run, naming them, until the user removes them."""
    argv, run = _earlier_run(tmp_path, capsys)
    state = run / "client_state"
    for folder in (run, state):
        (folder / MARK).unlink()
    (state / MANIFEST).unlink()
    (state / "my-notes.txt").write_text("mine")
    before = sorted(p.name for p in run.iterdir())
    code, err = _main([*argv, "--set", "overwrite=true"], capsys)
    assert code == 2 and "holds checkpoint.pt, rounds.csv, clients.csv, summary.json and no " \
        "fedgc mark" in err
    assert sorted(p.name for p in run.iterdir()) == before
    assert _main([*argv, "--set", "resume=true", "--set", "rounds=2"], capsys)[0] == 0
    assert owner_of(run).run_id == owner_of(state).run_id
    code, err = _main([*argv, "--set", "overwrite=true"], capsys)
    assert code == 2 and "client records in state_dir" in err and "(1.state, 2.state)" in err
    for record in state.glob("*.state"):
        record.unlink()
    assert _main([*argv, "--set", "overwrite=true"], capsys)[0] == 0
    assert (state / "my-notes.txt").read_text() == "mine"
    # A state_dir of its own choosing, unmarked and not empty, is still refused.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "0.state").write_text("?")
    code, err = _main([*argv, "--set", "overwrite=true", "--set", f"state_dir={other}"], capsys)
    assert code == 2 and "no run's mark" in err and (other / "0.state").read_text() == "?"


def test_overwrite_deletes_only_the_client_records_a_manifest_lists(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: a manifest line naming ``thesis.tex`` got that file deleted; a manifest
    symlinked elsewhere was read whole. Now the first deletes nothing of the user's and the
    second refuses the overwrite in one line, deleting nothing."""
    argv, run = _earlier_run(tmp_path, capsys)
    state = run / "client_state"
    records = sorted(p.name for p in state.glob("*.state"))
    (state / "thesis.tex").write_text("three years")
    with (state / MANIFEST).open("a") as fh:
        fh.write("thesis.tex\n")
    assert _main([*argv, "--set", "overwrite=true"], capsys)[0] == 0
    assert (state / "thesis.tex").read_text() == "three years"
    assert sorted(p.name for p in state.glob("*.state")) == records  # the new run's
    manifest = state / MANIFEST
    manifest.rename(tmp_path / "elsewhere")
    manifest.symlink_to(tmp_path / "elsewhere")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = _main([*argv, "--set", "overwrite=true"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "is not fedgc's manifest" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_refused_resume_creates_nothing(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: resume=true of a folder that never existed was refused after the folders
    were made: two ``.fedgc-owner.json`` files remained."""
    results = tmp_path / "results"
    code, err = _main(["run", *BASE, "--set", f"results_dir={results}", "--set", "run_name=new",
                       "--set", "resume=true"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"resume=true, but {results / 'new'} holds no checkpoint.pt" in err
    assert not results.exists()


#: Another process that holds a run folder's lock as a run does (server.folders.RunLock).
HOLDER = ("import sys, time\n"
          "from server.folders import RunLock\n"
          "RunLock(sys.argv[1]).acquire()\n"
          "print('held', flush=True)\n"
          "time.sleep(600)\n")


def test_one_process_at_a_time_runs_in_a_run_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: two resume=true of one run, or overwrite=true during a resume, both ran to
    exit 0 on the same folders. While another process holds the run folder (as a run does,
    from make_folders to its end) the second is refused in one line naming it, and deletes
    nothing; the kernel lets the lock go when that process dies (here: SIGKILL)."""
    argv = ["run", *BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=busy"]
    assert _main(argv, capsys)[0] == 0
    run = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
        for extra in (["--set", "resume=true", "--set", "rounds=2"],
                      ["--set", "overwrite=true"]):
            code, err = _main([*argv, *extra], capsys)
            assert code == 2 and len(err.splitlines()) == 1, err
            assert f"run folder {run} is in use by another fedgc process (pid " \
                f"{holder.pid} since" in err
            assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    finally:
        holder.kill()
        holder.wait()
    assert _main([*argv, "--set", "resume=true", "--set", "rounds=2"], capsys)[0] == 0
    assert load_checkpoint(run)["completed_rounds"] == 2
