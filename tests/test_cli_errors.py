"""Careless use of the command line: one line naming the path and the problem, exit 2; a run
that cannot work is refused before round 1, and one that aggregated nothing fails."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedgc.ownership import written
from simulations.cli import main

BASE = ["--set", "task=digits", "--set", "num_clients=4", "--set", "clients_per_round=2",
        "--set", "rounds=2", "--set", "sim.engine=local", "--set", "progress=false",
        "--set", "partition=iid"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["run", *argv])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write in (root writes through mode bits: a read-only
    filesystem then)."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o500)
        return folder
    folder = Path("/sys/fs")
    try:
        (folder / "fedgc-probe").mkdir()
    except OSError:
        return folder
    pytest.skip("no read-only folder to test with")


def test_config_that_is_a_folder_or_not_utf8(tmp_path: Path, capsys) -> None:
    code, err = _run(["--config", str(tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"--config {tmp_path} is a folder" in err
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('run_name = "caf\xe9"\n'.encode("latin-1"))
    code, err = _run(["--config", str(bad)], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"--config {bad} is not UTF-8" in err


def test_results_folder_that_is_a_file_or_read_only(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "results"
    afile.write_text("not a folder")
    code, err = _run([*BASE, "--set", f"results_dir={afile}", "--set", "run_name=r"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"run folder {afile / 'r'}" in err and "Not a directory" in err
    ro = _read_only_folder(tmp_path)
    code, err = _run([*BASE, "--set", f"results_dir={ro}", "--set", "run_name=r"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"run folder {ro / 'r'}" in err


def test_damaged_checkpoint_to_resume(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"\x00not a checkpoint")
    code, err = _run([*BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=r",
                      "--set", "resume=true"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"checkpoint {run_dir / 'checkpoint.pt'} is unreadable" in err


def test_runs_that_cannot_work_are_refused_before_round_one(tmp_path: Path, capsys) -> None:
    argv = [*BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=big"]
    code, err = _run([*argv, "--set", "num_clients=2000"], capsys)
    assert code == 2 and "num_clients=2000" in err and "1438 samples" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = _run([*argv, "--set", f"state_dir={blocker / 'state'}"], capsys)
    assert code == 2 and f"state_dir {blocker / 'state'} is not a writable folder" in err
    assert not (tmp_path / "big" / "rounds.csv").exists()  # no round ran


def test_a_misspelt_task_option_is_refused_before_the_run_is_announced(tmp_path: Path,
                                                                      capsys) -> None:
    code = main(["run", *BASE, "--set", f"results_dir={tmp_path}",
                 "--set", 'task_options={"test_fractoin": 0.2}'])
    out, err = capsys.readouterr()
    assert code == 2 and "unknown option(s) ['test_fractoin']" in err
    assert "running" not in out and not any(tmp_path.iterdir())


def test_a_resumed_run_says_the_round_it_resumes_after(tmp_path: Path, capsys) -> None:
    argv = ["run", *BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=r"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("fedgc: running dgc on digits") and first.endswith(
        f"2 rounds -> {tmp_path / 'r'}")
    assert main([*argv, "--set", "resume=true", "--set", "rounds=3"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"fedgc: resuming dgc on digits, 4 clients (2 per round) after round 2 "
                     f"(its checkpoint): rounds 3-3 -> {tmp_path / 'r'}")


def test_a_run_that_aggregated_nothing_fails(tmp_path: Path, capsys,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from client.app import app as real

    broken = ClientApp()  # identifies itself and evaluates, but every train round fails

    @broken.train()
    def train(msg: Message, context: Context) -> Message:
        raise RuntimeError("this client cannot train")

    @broken.query()
    def query(msg: Message, context: Context) -> Message:
        return real(msg, context)

    monkeypatch.setattr("client.app.app", broken)
    code, err = _run([*BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=none",
                      "--set", "fraction_evaluate=0"], capsys)
    assert code == 1 and "no round of 2 aggregated any update" in err
    assert "cannot train" in err
    with (tmp_path / "none" / "clients.csv").open() as fh:  # the evidence is kept
        assert {row["status"] for row in csv.DictReader(fh)} == {"error"}


def test_overwrite_deletes_only_what_fedgc_wrote(tmp_path: Path, capsys) -> None:
    """Issue 26 item 4: a pattern over file names deleted a user's resnet50_pretrained.pt,
    best.pt.bak and .notes.tmp; the manifest of what the run wrote deletes those files only."""
    state = tmp_path / "my-state"
    argv = [*BASE, "--set", f"results_dir={tmp_path}", "--set", "run_name=o",
            "--set", f"state_dir={state}", "--set", "method=dgc"]
    assert _run(argv, capsys)[0] == 0
    records = sorted(p.name for p in state.glob("*.state"))
    assert records and written(state) == records
    mine = {"thesis.tex": "the user's own", "resnet50_pretrained.pt": "weights",
            "best.pt.bak": "a backup", ".notes.tmp": "notes", "7.state.corrupt-1": "kept"}
    for name, text in mine.items():
        (state / name).write_text(text)
    (state / "sub").mkdir()
    code, err = _run([*argv, "--set", "overwrite=true", "--set", "rounds=1"], capsys)
    assert code == 0, err
    for name, text in mine.items():
        assert (state / name).read_text() == text, name
    assert (state / "sub").is_dir()
    with (tmp_path / "o" / "rounds.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 1  # the new run's, the old one's deleted
    # A record the manifest does not list would leak a residual into the new run: refused.
    (state / "9.state").write_text("not listed")
    code, err = _run([*argv, "--set", "overwrite=true"], capsys)
    assert code == 2 and "manifest does not list (9.state)" in err
    assert (state / "9.state").read_text() == "not listed"
