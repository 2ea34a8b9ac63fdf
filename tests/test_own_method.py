"""A compression method of the user's own (``method = module:callable``), on the example project
in ``examples/own_method/`` (Strom's threshold quantization), through the command line and the
Python API, with no file of fedgc changed for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedgc.methods import names
from fedgc.settings import RunConfig, SettingsError
from simulations.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
OWN = "own_method.method:make"
SMALL = ["--set", "task=digits", "--set", "sim.engine=local", "--set", "num_clients=6",
         "--set", "clients_per_round=3", "--set", "progress=false"]


@pytest.fixture
def examples_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/`` importable, as the example's README has it (PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _run(tmp_path: Path, name: str, *sets: str) -> tuple[dict, list[dict]]:
    from simulations.api import read_rounds_table

    argv = ["run", *SMALL, "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}",
            "--set", f"method={OWN}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    folder = tmp_path / name
    return json.loads((folder / "summary.json").read_text()), read_rounds_table(
        folder / "rounds.csv")


def test_own_method_learns_from_the_command_line(tmp_path: Path, examples_path: None) -> None:
    """Strom's threshold quantization on digits: it learns, sends +-tau at one bit each, and
    keeps a residual the server's acknowledgements keep whole."""
    summary, rounds = _run(tmp_path, "strom", "rounds=4")
    assert summary["method"] == OWN and summary["label"] == "Strom 2015"
    assert summary["config"]["strom.tau"] == 0.03
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.1
    assert summary["uplink_compression"] > 10 and summary["clients_rejected"] == 0
    from client.state import ClientStateStore

    store = ClientStateStore(tmp_path / "strom" / "client_state")
    assert store.keys() and all(store.load(k).pending is not None for k in store.keys())


def test_its_own_key_reaches_every_client(tmp_path: Path, examples_path: None) -> None:
    """strom.tau so large that no entry reaches it: every client sends nothing, the model does
    not move (the key travelled to the clients, which read it through the Method)."""
    _, rounds = _run(tmp_path, "silent", "rounds=2", "strom.tau=1e9")
    assert [r["nnz"] for r in rounds] == [0, 0]
    assert rounds[0]["accuracy"] == rounds[1]["accuracy"]
    assert rounds[0]["clients_aggregated"] == 3


def test_compare_runs_it_beside_fedgcs_methods(tmp_path: Path, examples_path: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", *SMALL, "--set", "rounds=2", "--set", f"results_dir={tmp_path}",
            "--set", "run_name=cmp", "--methods", f"dense,{OWN}"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(doc["methods"]) == {"dense", OWN}
    assert doc["methods"][OWN]["uplink_vs_dense"] > 10
    assert (tmp_path / "cmp" / "Strom_2015" / "rounds.csv").exists()
    out = capsys.readouterr().out
    # The table and the line under it name the method by its label, never by its callable.
    assert "Strom 2015" in out and OWN not in out
    footer = next(line for line in out.splitlines() if line.startswith("last-10 accuracy at"))
    assert "Strom 2015" in footer or "dense's" in footer


def test_the_python_api_runs_and_compares_it(tmp_path: Path, examples_path: None) -> None:
    from simulations.api import compare, run

    common = {"task": "digits", "sim.engine": "local", "results_dir": str(tmp_path),
              "num_clients": 6, "clients_per_round": 3, "rounds": 2, "progress": False}
    mine = run(config=common, method=OWN, strom__tau=0.01, run_name="api")
    assert mine.summary["config"]["strom.tau"] == 0.01 and len(mine.rounds) == 2
    both = compare(config=common, methods=["dgc", OWN], run_name="api_cmp")
    assert set(both.summary["methods"]) == {"dgc", OWN}
    assert both.runs[OWN][0].folder == tmp_path / "api_cmp" / "Strom_2015"
    assert both.plot().stat().st_size > 10_000


@pytest.mark.parametrize(("method", "message"), [
    ("no_such_pkg.method:make", r"no module named 'no_such_pkg'.*PYTHONPATH"),
    ("own_method.method:no_such", r"'own_method.method' has no attribute 'no_such'"),
    ("json:loads", r"calling it raised TypeError"),
    ("own_method.method:StromSettings", r"returned StromSettings .*expected a "
                                        r"fedgc.methods.Method"),
    ("own_method.method:StromSettings.__doc__", r"is a str, not a callable"),
])
def test_a_bad_method_callable_is_one_line_before_round_1(
        tmp_path: Path, examples_path: None, capsys: pytest.CaptureFixture[str], method: str,
        message: str) -> None:
    import re

    argv = ["run", *SMALL, "--set", f"results_dir={tmp_path}", "--set", f"method={method}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"method = {method!r}" in err
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(("values", "message"), [
    ({"method": "fedprox"}, r"method = 'fedprox' is outside the accepted range one of "
                            + re.escape(str(list(names()))) + r", or 'module:callable'"),
    ({"method": OWN, "strom.tau": -1}, r"strom.tau = -1.0 is outside the accepted range"),
    ({"method": OWN, "strom.tua": 0.1},
     r"unknown configuration key 'strom.tua' \(did you mean 'strom.tau'\?\)"),
])
def test_bad_method_keys_are_named(values: dict, message: str, examples_path: None) -> None:
    with pytest.raises(SettingsError, match=message):
        RunConfig.from_flat(values)


def test_the_example_readme_names_the_callable() -> None:
    text = (EXAMPLES / "own_method" / "README.md").read_text()
    assert f"--methods dense,dgc,{OWN}" in text and "PYTHONPATH" in text
