"""Careless and hostile inputs, second round (issue 26): each is one line naming the input and
what is accepted, exit 2, never a traceback, and nothing is created."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedgc.settings import MAX_CONFIG_BYTES, RunConfig, SettingsError, load_toml
from simulations.cli import main


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


# ------------------------------------------------------------------ settings and config files


def test_options_nested_past_the_recursion_limit_are_one_settings_error() -> None:
    deep_text = '{"a":' * 100_000 + "1" + "}" * 100_000
    with pytest.raises(SettingsError, match="task_options is nested too deeply"):
        RunConfig.from_flat({"task": "digits", "task_options": deep_text})
    deep: dict[str, object] = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]  # type: ignore[assignment]
    with pytest.raises(SettingsError, match="model_options is nested too deeply"):
        RunConfig.from_flat({"model_options": deep})


@pytest.mark.parametrize("text", ["x = " + "[" * 100_000 + "]" * 100_000 + "\n",
                                  "x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n"])
def test_a_config_file_nested_too_deeply_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(text)
    code, err = _main(["run", "--config", str(path), "--set", f"results_dir={tmp_path / 'r'}"],
                      capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"config file {path} nests tables or arrays too deeply" in err
    assert not (tmp_path / "r").exists()


def test_a_config_file_that_never_ends_or_is_huge_is_refused_unread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer for ever
    huge = tmp_path / "huge.toml"
    huge.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    for path, words in ((Path("/dev/zero"), "is not a regular file"),
                        (fifo, "is not a regular file"),
                        (huge, f"is over {MAX_CONFIG_BYTES} bytes")):
        code, err = _main(["run", "--config", str(path)], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and f"{path} {words}" in err
    with pytest.raises(SettingsError, match="is not a regular file"):
        load_toml("/dev/zero")


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "bell\a", "esc\x1b[31m"])
def test_a_run_name_with_a_control_character_is_refused(name: str) -> None:
    with pytest.raises(SettingsError, match="holds a control character"):
        RunConfig.from_flat({"run_name": name})


# ------------------------------------------------------------------ traffic over bad folders


def _comparison(base: Path) -> Path:
    for method in ("dense", "dgc"):
        run = base / method
        run.mkdir(parents=True)
        (run / "rounds.csv").write_text("round,accuracy,loss,uplink_bytes,downlink_bytes\n"
                                        "1,0.5,1,100,100\n2,0.6,1,100,100\n")
        (run / "summary.json").write_text(json.dumps({
            "method": method, "uplink_bytes": 200, "downlink_bytes": 200, "total_bytes": 400,
            "config": {"seed": 0}}))
    return base


def _break(base: Path, how: str) -> tuple[Path, str]:
    """Damage a comparison as ``how`` says; return the folder to read and the expected words."""
    rounds = base / "dgc" / "rounds.csv"
    if how == "empty rounds.csv":
        rounds.write_text("")
        return base, f"{rounds} is empty"
    if how == "string number":
        (base / "dgc" / "summary.json").write_text(json.dumps({
            "method": "dgc", "uplink_bytes": "200", "config": {"seed": 0}}))
        return base, "summary.json: uplink_bytes = '200' is not a number"
    if how == "negative bytes":
        rounds.write_text("round,accuracy,loss,uplink_bytes,downlink_bytes\n1,0.5,1,-100,100\n")
        return base, f"{rounds}: row 1 has a negative byte count -100"
    if how == "rounds.csv a folder":
        rounds.unlink()
        rounds.mkdir()
        return base, f"{rounds} is not a regular file"
    if how == "rounds.csv a FIFO":
        rounds.unlink()
        os.mkfifo(rounds)
        return base, f"{rounds} is not a regular file"
    if how == "seed-²":
        seeded = base.parent / "seeded"
        seeded.mkdir()
        base.rename(seeded / "seed-\u00b2")  # int() refuses the digit str.isdigit() accepts
        return seeded, "holds no run"
    if how == "no round at all":
        for method in ("dense", "dgc"):
            (base / method / "rounds.csv").write_text(
                "round,accuracy,loss,uplink_bytes,downlink_bytes\n")
        return base, "has a round: nothing to compare"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["empty rounds.csv", "string number", "negative bytes",
                                 "rounds.csv a folder", "rounds.csv a FIFO", "seed-²",
                                 "no round at all"])
def test_traffic_names_what_is_wrong_with_a_comparison_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    folder, words = _break(_comparison(tmp_path / "cmp"), how)
    code, err = _main(["traffic", str(folder)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err


def test_traffic_reads_a_run_without_rounds_as_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _comparison(tmp_path / "cmp")
    (base / "dgc" / "rounds.csv").write_text("round,accuracy,loss,uplink_bytes,downlink_bytes\n")
    assert main(["traffic", str(base)]) == 0
    assert "dense 0.5500, dgc n/a" in capsys.readouterr().out  # words, never nan


def test_traffic_out_naming_a_file_is_refused_and_the_file_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _comparison(tmp_path / "cmp")
    afile = tmp_path / "notes.txt"
    afile.write_text("the user's")
    code, err = _main(["traffic", str(base), "--out", str(afile)], capsys)
    assert code == 2 and f"--out {afile} is not a folder" in err
    assert afile.read_text() == "the user's"


# ------------------------------------------------------------------ resume and the emulator


@pytest.mark.parametrize("first, then, words", [
    (["netem.enabled=true"], ["netem.enabled=false"], "netem.enabled = True (now unset)"),
    ([], ["netem.enabled=true"], "netem.enabled = unset (now True)"),
])
def test_a_resume_cannot_switch_the_emulator_off_or_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], first: list[str], then: list[str],
        words: str) -> None:
    """Issue 26 item 6: ``--set netem.enabled=false`` on a netem checkpoint was accepted (keys
    one side lacks were not compared) and virtual time dropped to 0 mid-run."""
    base = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set", "num_clients=4",
            "--set", "clients_per_round=2", "--set", "progress=false", "--set", "partition=iid",
            "--set", f"results_dir={tmp_path}", "--set", "run_name=r"]
    sets = [x for s in first for x in ("--set", s)]
    assert main([*base, "--set", "rounds=1", *sets]) == 0
    capsys.readouterr()
    again = [x for s in then for x in ("--set", s)]
    code, err = _main([*base, "--set", "rounds=2", "--set", "resume=true", *again], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert len((tmp_path / "r" / "rounds.csv").read_text().splitlines()) == 2  # round 1 only
