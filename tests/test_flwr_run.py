"""``flwr run .``: the app config of pyproject.toml, a small run on Flower's simulation runtime,
and a bad ``-c`` key or value.

The runs go through Flower's real path: ``flwr run`` builds the app bundle, submits it to a local
SuperLink (started here, on free ports, with its own ``FLWR_HOME``, and stopped afterwards), whose
``flwr-simulation`` process runs ``server.app:app`` and ``client.app:app`` on Ray. Each bundles
the project's app as ``python -m simulations flwr`` stages it (``tests/test_flwr_app.py``: the
same FAB). The one run that trains is the wrapper's (``wrapped``), which two tests read: the
command's own behaviour, and the keys that reached the ServerApp through ``-c``.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from fedgc.settings import RunConfig, flatten
from server.app import ENGINE_KEY_PREFIX, flwr_app_config, flwr_app_config_toml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_app_config_holds_every_key_with_the_clis_default():
    with (ROOT / "pyproject.toml").open("rb") as fh:
        table = flatten(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])
    expected = flwr_app_config()
    assert table == expected and {k: type(v) for k, v in table.items()} == {
        k: type(v) for k, v in expected.items()}, (
        "pyproject.toml's [tool.flwr.app.config] differs from RunConfig; replace it with the "
        "output of `python -m simulations keys --flwr-toml`:\n" + flwr_app_config_toml())
    engine_keys = {k for k in RunConfig.keys() if k.startswith(ENGINE_KEY_PREFIX)}
    assert engine_keys and set(table) == set(RunConfig.keys()) - engine_keys


@pytest.fixture(scope="module")
def app_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's app as ``python -m simulations flwr`` stages it (the files Flower keeps,
    copied: ``tests/test_flwr_app.py``), once for the module's runs."""
    from simulations.flwr_app import stage_app

    return stage_app(ROOT, tmp_path_factory.mktemp("flwr_app"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of a ``flwr run`` that finds a local SuperLink of its own running."""
    home = tmp_path_factory.mktemp("flwr_home")
    http_port, control_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_HOME": str(home),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    # The command `flwr run` starts for a `:local:` connection (flwr/cli/local_superlink.py).
    log = home / "superlink.log"
    link = subprocess.Popen(
        [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation",
         "subprocess", "--control-api-address", f"127.0.0.1:{control_port}", "--host",
         "127.0.0.1", "--port", str(http_port), "--log-file", str(log), "--database",
         str(home / "state.db")], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=1):
                    break
            except OSError:
                assert link.poll() is None, f"flower-superlink exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "flower-superlink did not start in 60 s"
                time.sleep(0.5)
        env["SUPERLINK_LOG"] = str(log)
        yield env
    finally:
        link.terminate()
        try:
            link.wait(timeout=30)
        except subprocess.TimeoutExpired:
            link.kill()
            link.wait()
        # The SuperExec starts each flwr-simulation (and its Ray) in a session of its own, which
        # may outlive the SuperLink: stop every process that inherited this FLWR_HOME.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _processes_with(f"FLWR_HOME={home}"):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:  # ended in between
                    pass
            deadline = time.monotonic() + 15
            while _processes_with(f"FLWR_HOME={home}") and time.monotonic() < deadline:
                time.sleep(0.5)
        assert _processes_with(f"FLWR_HOME={home}") == [], "processes of the run outlived it"


def _processes_with(variable: str) -> list[int]:
    """Ids of this user's processes whose environment holds ``variable`` (``NAME=value``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if variable.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def _flwr_run(env: dict[str, str], app: Path, config: str, supernodes: int = 3
              ) -> subprocess.CompletedProcess[str]:
    """``flwr run .`` in ``app`` (:func:`app_folder`) with ``-c config``."""
    return subprocess.run([str(BIN / "flwr"), "run", ".", "--federation-config",
                           f"num-supernodes={supernodes}", "-c", config, "--stream"],
                          cwd=app, env=env, capture_output=True, text=True, timeout=900)


SMALL = "task='digits' num_clients=3 clients_per_round=2 rounds=2 seed=1"


@pytest.mark.slow
def test_a_bad_value_is_one_line_in_the_runs_log_and_fails_the_run(flwr_env, app_folder,
                                                                   tmp_path):
    proc = _flwr_run(flwr_env, app_folder, f"{SMALL} density=2.0 results_dir='{tmp_path}'")
    output = proc.stdout + proc.stderr
    assert "fedgc: density = 2.0 is outside the accepted range (0, 1]" in output, \
        output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not list(tmp_path.iterdir())
    assert _status(flwr_env, output) == ("finished:failed", "Simulation failed with exception: "
                                         "density = 2.0 is outside the accepted range (0, 1]")


@pytest.mark.slow
def test_a_federation_without_a_supernode_per_client_stops_with_how_to_size_it(flwr_env,
                                                                               app_folder):
    # Flower's default federation has 2 SuperNodes; the run has 3 clients.
    proc = _flwr_run(flwr_env, app_folder, SMALL, supernodes=2)
    output = proc.stdout + proc.stderr
    line = ("fedgc: the federation has 2 simulated SuperNodes and this run num_clients = 3 (one "
            "SuperNode per client): run it with `flwr run . --federation-config "
            "num-supernodes=3`, or size the run to the federation with -c \"num_clients=2 "
            "clients_per_round=2\"")
    assert line in output and "Traceback" not in output, output[-3000:]
    assert _status(flwr_env, output)[0] == "finished:failed"


def _status(env: dict[str, str], output: str) -> tuple[str, str]:
    """Flower's status and reason of the run ``output`` started."""
    from simulations.flwr_run import run_status

    run_id = output.split("Successfully started run ", 1)[1].split()[0]
    return run_status(run_id, env)


def test_a_bad_key_is_refused_and_named_in_the_superlinks_log(flwr_env, app_folder):
    proc = _flwr_run(flwr_env, app_folder, "rounds=2 dgc.shared_densty=0")
    assert proc.returncode != 0
    assert "Invalid run configuration" in proc.stdout + proc.stderr
    # Flower keeps the reason from the CLI (a FlowerError's message is not sent to clients);
    # its SuperLink logs it.
    log = Path(flwr_env["SUPERLINK_LOG"]).read_text()
    assert "Key 'dgc.shared_densty' is not present" in log, log[-2000:]


class _SlowFederation:
    """A grid whose second SuperNode connects on the fourth look."""

    def __init__(self) -> None:
        self.looks = 0

    def get_node_ids(self) -> list[int]:
        self.looks += 1
        return [7, 8] if self.looks > 3 else [7]


def test_waiting_for_supernodes_says_how_to_size_the_federation(monkeypatch, caplog):
    import server.registry as registry

    monkeypatch.setattr(registry, "HINT_AFTER_S", 0.0)
    monkeypatch.setattr(registry.time, "sleep", lambda seconds: None)
    with caplog.at_level("INFO", logger="flwr"):
        nodes = registry.ClientRegistry().wait_for_nodes(_SlowFederation(), 2)
    assert nodes == [7, 8]
    hints = [r.getMessage() for r in caplog.records if "num-supernodes" in r.getMessage()]
    assert len(hints) == 1 and "only 1 SuperNodes are connected and this run needs 2" in hints[0]


def test_keys_flwr_toml_prints_the_table_it_checks(capsys):
    from simulations.cli import main

    assert main(["keys", "--flwr-toml"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert flatten(printed["tool"]["flwr"]["app"]["config"]) == flwr_app_config()


@pytest.mark.parametrize("sets, words", [
    (["dgc.shared_densty=0"], "unknown configuration key 'dgc.shared_densty' (did you mean "
                              "'dgc.shared_density'?)"),
    (["density=2"], "density = 2.0 is outside the accepted range (0, 1]"),
    (["netem.enabled=true"], "netem.enabled: not settable under flwr run"),
    (["sim.engine=local"], "sim.engine: not settable under flwr run"),
])
def test_python_m_simulations_flwr_checks_the_keys_before_anything_starts(sets, words, capsys,
                                                                          monkeypatch):
    from simulations import flwr_run
    from simulations.cli import main

    def started(*args, **kwargs):
        raise AssertionError("nothing may start for a bad key")

    monkeypatch.setattr(flwr_run.subprocess, "Popen", started)
    argv = ["flwr"] + [x for kv in sets for x in ("--set", kv)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_the_flwr_command_sizes_the_federation_and_passes_only_the_given_keys(tmp_path):
    from simulations.flwr_run import flwr_command, run_overrides

    config, given = run_overrides({"task": "digits", "num_clients": "7", "rounds": "3",
                                   "clients_per_round": "2", "density": "0.01",
                                   "results_dir": "rel"})
    assert given == {"task": "digits", "num_clients": 7, "rounds": 3, "clients_per_round": 2,
                     "density": 0.01,
                     "results_dir": str(Path("rel").resolve()),
                     "run_name": config.server.run_name,
                     "state_dir": str(config.state_dir.resolve())}
    command = flwr_command(tmp_path, given, config.train.num_clients)
    assert command[1:5] == ["run", str(tmp_path), "--stream", "--federation-config"]
    assert command[5] == "num-supernodes=7"
    pairs = tomllib.loads(command[-1].replace(" ", "\n"))
    assert flatten(pairs) == given


class WrappedRun(NamedTuple):
    """One ``python -m simulations flwr`` run from a fresh ``FLWR_HOME``, for the tests below."""

    proc: subprocess.CompletedProcess[str]
    output: str
    run: Path
    left: list[int]  # processes with the run's FLWR_HOME that outlived the command (killed)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> WrappedRun:
    """The wrapper's run, once for the module (each run costs a SuperLink's start, a
    ``flwr-simulation`` and a Ray instance): its own tests read the command's behaviour, the
    training test what reached the ServerApp through ``-c``."""
    tmp_path = tmp_path_factory.mktemp("wrapped")
    home = tmp_path / "flwr_home"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_HOME": str(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()), "FLWR_DISABLE_UPDATE_CHECK": "1"}
    argv = [sys.executable, "-m", "simulations", "flwr"]
    for kv in ("task=digits", "num_clients=3", "clients_per_round=2", "rounds=2",
               "dgc.shared_density=0", "dgc.warmup_rounds=1",
               f"results_dir={tmp_path / 'results'}", "run_name=wrapped"):
        argv += ["--set", kv]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    left = _processes_with(f"FLWR_HOME={home}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return WrappedRun(proc, proc.stdout + proc.stderr, tmp_path / "results" / "wrapped", left)


@pytest.mark.slow
def test_python_m_simulations_flwr_from_a_fresh_flwr_home(wrapped):
    """The wrapper starts the local SuperLink `flwr run` would start, runs, reports the run's
    status as its own, and stops the SuperLink and everything it started."""
    output = wrapped.output
    assert wrapped.proc.returncode == 0, output[-3000:]
    assert "started a local SuperLink" in output and "num-supernodes=3" in output
    rows = list(csv.DictReader((wrapped.run / "rounds.csv").open()))
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert "final acc" in output  # the summary table, as `run` prints it
    assert wrapped.left == [], "the SuperLink, or a process it started, outlived the command"


@pytest.mark.slow
def test_flwr_run_trains_and_takes_dotted_keys(wrapped):
    """Through `flwr run`'s -c (as the wrapper passes the keys given): the run trains, dotted
    keys reach the ServerApp, the keys not given keep pyproject's app config."""
    assert wrapped.proc.returncode == 0, wrapped.output[-3000:]
    with (wrapped.run / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert all(int(r["clients_aggregated"]) == 2 for r in rows)
    config = json.loads((wrapped.run / "summary.json").read_text())["config"]
    assert (config["dgc.shared_density"], config["dgc.warmup_rounds"]) == (0.0, 1)
    assert (config["num_clients"], config["lr"], config["local_epochs"]) == (3, 0.1, 2)
    assert "fraction_evaluate is set to 0.0" not in wrapped.output  # flower_log.drop_noise
