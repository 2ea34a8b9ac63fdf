"""A model and data of the user's own (``task = module:callable``), the shipped models' option
keys and ``data_dir``, and the Python API (``simulations.api``), on the example project in
``examples/own_task/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from fedgc.settings import RunConfig, SettingsError
from fedgc.task_loader import load_task
from simulations.cli import main
from tasks import Task

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
OWN = "own_task.task:build"
SMALL = ["--set", "sim.engine=local", "--set", "num_clients=6", "--set", "clients_per_round=3",
         "--set", "progress=false"]


@pytest.fixture
def examples_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/`` importable, as the example's README has it (PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _run(tmp_path: Path, name: str, *sets: str) -> tuple[dict, list[dict]]:
    argv = ["run", *SMALL, "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    from simulations.api import read_rounds_table

    folder = tmp_path / name
    return json.loads((folder / "summary.json").read_text()), read_rounds_table(
        folder / "rounds.csv")


def test_own_task_learns_from_the_command_line(tmp_path: Path, examples_path: None) -> None:
    """The example's WaveNet on its generated waves, 3 DGC rounds: well above chance (0.25)."""
    summary, rounds = _run(tmp_path, "own", f"task={OWN}", "rounds=3",
                           'task_options={"num_train": 1200, "num_test": 400}')
    assert summary["task"] == OWN
    assert summary["num_parameters"] == 8 * 5 + 8 + 8 * 16 * 64 + 64 + 64 * 4 + 4
    assert rounds[-1]["accuracy"] > 0.6
    assert rounds[-1]["loss"] < rounds[0]["loss"]
    assert summary["uplink_compression"] > 2  # DGC sparsified the 8192-entry dense layer


def test_task_options_reach_server_and_clients(tmp_path: Path, examples_path: None) -> None:
    """hidden=16 shrinks the model on the server and on every client (or the run would fail)."""
    summary, rounds = _run(tmp_path, "small", f"task={OWN}", "rounds=1",
                           'task_options={"num_train": 300, "num_test": 100, "hidden": 16}')
    assert summary["num_parameters"] == 8 * 5 + 8 + 8 * 16 * 16 + 16 + 16 * 4 + 4
    assert rounds[0]["clients_aggregated"] == 3


@pytest.mark.parametrize(("task", "options", "message"), [
    ("no_such_pkg.task:build", "", r"no module named 'no_such_pkg'.*PYTHONPATH"),
    ("own_task.task:no_such", "", r"'own_task.task' has no attribute 'no_such'"),
    ("own_task.task:build", '{"length": 7}', r"raised ValueError: length must be an even"),
    ("own_task.task:waves", "", r"raised TypeError"),
    ("own_task.task:FREQUENCIES", "", r"is a tuple, not a callable"),
    ("json:loads", '{"s": "[1, 2]"}', r"returned list \(\[1, 2\]\); expected a tasks.Task"),
])
def test_a_bad_task_callable_is_named_before_round_1(
        tmp_path: Path, examples_path: None, capsys: pytest.CaptureFixture[str], task: str,
        options: str, message: str) -> None:
    argv = ["run", *SMALL, "--set", f"results_dir={tmp_path}", "--set", f"task={task}",
            "--set", f"task_options={options}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"task = {task!r}" in err
    assert re.search(message, err), err
    assert not (tmp_path / "default" / "rounds.csv").exists()


@pytest.mark.parametrize(("values", "message"), [
    ({"task": "own_task.task:build", "model": "mlp"}, r"model set with task"),
    ({"task": "own_task.task:build", "data_dir": "/tmp"}, r"data_dir set with task"),
    ({"task": "own task:build"}, r"task = 'own task:build' is outside the accepted range"),
    ({"task_options": "[1]"}, r"task_options = '\[1\]' must be a JSON object"),
    ({"model_options": "{hidden: 3}"}, r"model_options = .* is not JSON"),
    ({"model": "resnet"}, r"model = 'resnet' is outside the accepted range"),
])
def test_bad_task_keys_are_named(values: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        RunConfig.from_flat(values)


def test_options_keys_take_toml_tables_and_dicts(tmp_path: Path) -> None:
    """``[model_options]`` in a TOML file, a dict from Python, JSON text and dotted keys are one
    value."""
    from fedgc.settings import load_toml

    path = tmp_path / "run.toml"
    # A named run: an unnamed one is named by the second it is made in, which may change
    # between these four.
    path.write_text('task = "mnist5k"\ndensity = 0.01\nrun_name = "o"\n[model_options]\n'
                    'hidden = [64, 32]\n')
    from_toml = RunConfig.from_flat(load_toml(path))
    from_dict = RunConfig.from_flat({"model_options": {"hidden": [64, 32]}, "density": 0.01,
                                     "run_name": "o"})
    from_text = RunConfig.from_flat({"model_options": '{"hidden": [64, 32]}',
                                     "density": "0.01", "run_name": "o"})
    # What Flower makes of a [tool.flwr.app.config.model_options] table: dotted keys.
    from_flower = RunConfig.from_flat({"model_options.hidden": [64, 32], "density": 0.01,
                                       "run_name": "o"})
    assert from_toml == from_dict == from_text == from_flower
    assert from_toml.train.model_options == '{"hidden": [64, 32]}'
    model = load_task(from_toml.train.task_spec()).build_model()
    assert [m.out_features for m in model.modules() if hasattr(m, "out_features")] == [64, 32, 10]
    with pytest.raises(SettingsError, match=r"model_options must hold JSON values"):
        RunConfig.from_flat({"model_options": {"hidden": {1, 2}}})


def test_model_keys_and_data_dir_reach_the_shipped_loaders(tmp_path: Path) -> None:
    """``task = mnist`` reads IDX files from data_dir (here Debian's Fashion-MNIST, which has
    MNIST's file names); model and model_options build a CNN of the asked size everywhere."""
    debian = Path("/usr/share/datasets/fashion-mnist")
    if not debian.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    data = tmp_path / "idx"
    shutil.copytree(debian, data)
    summary, rounds = _run(tmp_path, "mnist", "task=mnist", f"data_dir={data}", "model=cnn",
                           'model_options={"channels": [4, 8], "hidden": 16}', "rounds=1",
                           "eval_samples=500", "local_steps=5", "partition=iid")
    # conv 1->4 and 4->8 (5x5), dense 8*7*7 -> 16 -> 10
    assert summary["num_parameters"] == (4 * 25 + 4) + (8 * 4 * 25 + 8) + (392 * 16 + 16) + (
        16 * 10 + 10)
    assert summary["config"]["data_dir"] == str(data)
    assert rounds[0]["clients_aggregated"] == 3


def test_a_missing_data_dir_fails_before_round_1(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", *SMALL, "--set", f"results_dir={tmp_path}", "--set", "task=mnist",
            "--set", f"data_dir={tmp_path / 'none'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte" in err and str(tmp_path / "none") in err


def test_the_python_api_runs_compares_and_plots(tmp_path: Path, examples_path: None) -> None:
    """run() and compare() return what the command line wrote: summary, round rows, plots."""
    from simulations.api import compare, run

    options = {"num_train": 600, "num_test": 200}
    result = run(config={"task": OWN, "sim.engine": "local", "results_dir": str(tmp_path)},
                 task_options=options, num_clients=4, clients_per_round=2, rounds=2,
                 run_name="api", progress=False, density=0.01)
    assert result.folder == tmp_path / "api"
    assert result.summary["config"]["density"] == 0.01
    assert [r["round"] for r in result.rounds] == [1, 2]
    assert isinstance(result.rounds[0]["uplink_bytes"], int)
    assert result.summary["final_accuracy"] == result.rounds[-1]["accuracy"]
    png = result.plot(tmp_path / "mine.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"

    both = compare(config={"task": OWN, "sim.engine": "local", "results_dir": str(tmp_path)},
                   methods=["dense", "dgc"], task_options=options, num_clients=4,
                   clients_per_round=2, rounds=2, run_name="cmp", progress=False)
    assert set(both.summary["methods"]) == {"dense", "dgc"}
    dgc = both.runs["dgc"][0]
    assert dgc.folder == tmp_path / "cmp" / "dgc"
    assert both.summary["methods"]["dgc"]["uplink_bytes"] == sum(
        r["uplink_bytes"] for r in dgc.rounds)
    assert both.summary["methods"]["dgc"]["uplink_vs_dense"] > 1
    assert both.plot().name == "compare.png"
    with pytest.raises(SettingsError, match="methods must be"):
        compare(methods=["fedprox"])


def test_the_example_readme_names_the_callable(examples_path: None) -> None:
    """The README's command names the example's callable and the PYTHONPATH it needs; the
    callable's data is the same for the same seed (server and clients must agree)."""
    from own_task.task import build

    text = (EXAMPLES / "own_task" / "README.md").read_text()
    assert f"--set task={OWN}" in text and "PYTHONPATH" in text
    a, b, c = build(num_train=8, num_test=4), build(num_train=8, num_test=4), build(
        num_train=8, num_test=4, seed=1)
    assert isinstance(a, Task) and a.train_x.shape == (8, 1, 32)
    assert a.train_x.equal(b.train_x) and not a.train_x.equal(c.train_x)


@pytest.mark.slow
def test_own_task_on_the_ray_engine(tmp_path: Path, examples_path: None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's workers import the task's module from PYTHONPATH, as the README documents.

    One Ray CPU, so one ClientApp actor (each imports torch and fedgc: seconds of CPU): the one
    worker trains both clients, and a worker without the module on its path fails the round."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(EXAMPLES)]))
    argv = ["run", "--set", "sim.engine=ray", "--set", "sim.num_cpus=1", "--set",
            "num_clients=2", "--set", "clients_per_round=2", "--set", "rounds=1",
            "--set", "progress=false", "--set", f"results_dir={tmp_path}",
            "--set", f"task={OWN}", "--set", 'task_options={"num_train": 200, "num_test": 100}',
            "--set", "run_name=ray"]
    assert main(argv) == 0
    rows = (tmp_path / "ray" / "rounds.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[6] == "2"  # clients_aggregated


def test_model_fn_must_build_a_module() -> None:
    import torch

    from tasks import DataError

    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(DataError, match=r"model_fn must be callable .*, got 3"):
        Task("t", "m", 2, x, y, x, y, model_fn=3)  # type: ignore[arg-type]
    task = Task("t", "m", 2, x, y, x, y, model_fn=lambda: "net")  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"task 't': model_fn returned str, expected a "
                                        r"torch.nn.Module"):
        task.build_model()
    task = Task("t", "m", 2, x, y, x, y, model_fn=lambda: torch.nn.Linear(3, 2))
    assert [p.shape for p in task.build_model().parameters()] == [(2, 3), (2,)]
