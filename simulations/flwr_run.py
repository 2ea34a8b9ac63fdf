"""``python -m simulations flwr``: Flower's own ``flwr run .``, with fedgc's checks around it.

Flower 1.42's ``flwr run . --stream`` leaves four things to its user that this command does:

1. The keys are checked before anything starts, by fedgc's settings engine: a misspelt key is
   named with the key it resembles, a bad value with its range, one line, exit status 2
   (Flower's SuperLink answers a misspelt key with ``[code: 15] Invalid run configuration``
   and names it only in its own log; a bad value fails the run after it started).
2. The simulated federation is sized to the run: ``--federation-config
   num-supernodes=<num_clients>`` (Flower's default federation has 2 SuperNodes).
3. When Flower's default connection is the local SuperLink and none answers, it starts one
   (the command ``flwr run`` would start) and stops it afterwards with every process it started
   (``flwr run`` starts one and leaves it running); a SuperLink that was running is left alone.
4. The exit status is the run's: 0 when Flower reports it ``finished:completed``, 1 otherwise,
   with Flower's status and reason in one line (``flwr run --stream`` exits 0 either way).

The run itself is ``flwr run`` on the project's app, the same ServerApp and ClientApp, with the
keys given (``--scenario``, ``--config``, ``--set``) passed as ``-c``. Flower bundles the app
from a copy of the files it keeps of the project folder (:mod:`simulations.flwr_app`: the same
files, so the same FAB), staged in a temporary folder removed after the run: ``flwr run`` on the
folder itself walks and resolves every file under it first, a virtualenv's 60,000 included
(12-16 s of CPU).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from flwr.cli.utils import AppPathDepthError

from fedgc.settings import RunConfig, SettingsError
from server.app import ENGINE_KEY_PREFIX
from simulations.cli_common import summary_table
from simulations.flwr_app import staged_app

#: The project folder: the Flower app ``flwr run`` bundles (from :func:`staged_app`'s copy).
PROJECT = Path(__file__).resolve().parents[1]
#: The environment variable that marks every process of a SuperLink this command started.
OWNER_VARIABLE = "FEDGC_FLWR_SUPERLINK"
#: Seconds a SuperLink may take to answer after its start (Flower's own CLI allows 30).
START_TIMEOUT_S = 60.0
#: Seconds to wait for Flower to mark a run finished after its log stream ended.
STATUS_TIMEOUT_S = 30.0


def _bin(name: str) -> str:
    """``name``'s executable beside this Python's (the environment fedgc runs in)."""
    return str(Path(sys.executable).with_name(name))


def environment() -> dict[str, str]:
    """The environment of Flower's processes: this one, with this Python's folder first on
    PATH (the SuperLink starts ``flower-superexec`` and ``flwr-simulation`` by name) and the
    app run in it rather than in a fresh environment of its dependencies."""
    return {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_overrides(values: Mapping[str, object]) -> tuple[RunConfig, dict[str, object]]:
    """The checked RunConfig of ``values`` and the keys to pass to ``flwr run -c``.

    Only the keys given are passed (the app config holds the defaults), plus ``run_name`` (so
    that the run folder is known here) and absolute ``results_dir`` and ``state_dir`` (the
    ServerApp runs in a SuperLink's process, which may have started in another folder).

    Raises
    ------
    SettingsError
        A key that is unknown (named with the closest one), out of range, or not settable
        under ``flwr run``: ``sim.*`` (the federation config decides them) and ``netem.*``
        (the emulator wraps the apps in-process, under ``python -m simulations`` only).
    """
    for prefix, why in ((ENGINE_KEY_PREFIX, "the federation config decides those"),
                        ("netem.", "the network emulator runs under `python -m simulations "
                                   "run` only")):
        taken = sorted(k for k in values if k.startswith(prefix))
        if taken:
            raise SettingsError(f"{', '.join(taken)}: not settable under flwr run ({why})")
    config = RunConfig.from_flat(values)
    flat = config.to_flat()
    given = {k: flat[k] for k in values}
    given["run_name"] = config.server.run_name
    given["results_dir"] = str(Path(config.server.results_dir).resolve())
    given["state_dir"] = str(config.state_dir.resolve())
    return config, given


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of printable characters is a TOML string
    return repr(value)


def flwr_command(app: Path, given: Mapping[str, object], num_clients: int,
                 verbose: bool = False) -> list[str]:
    """The ``flwr run`` command line of a run of the app in the folder ``app``: the keys as
    ``-c``, the federation sized (``verbose``: Flower's simulation logs at DEBUG)."""
    pairs = " ".join(f"{k}={_toml(v)}" for k, v in given.items())
    federation = f"num-supernodes={num_clients}" + (" verbose=true" if verbose else "")
    return [_bin("flwr"), "run", str(app), "--stream", "--federation-config", federation,
            "-c", pairs]


def _local_ports() -> tuple[str, str] | None:
    """(HTTP port, Control API address) of Flower's local SuperLink when the default
    connection is the local one, else None (a remote SuperLink is the user's)."""
    from flwr.cli import constant
    from flwr.cli.flower_config import read_superlink_connection

    conn = read_superlink_connection(None)
    if conn.address not in (constant.LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
                            constant.LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY):
        return None
    return constant.LOCAL_SUPERLINK_HTTP_API_PORT, constant.LOCAL_CONTROL_API_ADDRESS


def _answers(port: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
            return True
    except OSError:
        return False


class LocalSuperLink:
    """The local SuperLink for one run: started here when none answers, stopped afterwards
    with every process it started (each carries :data:`OWNER_VARIABLE` = a token of its own,
    inherited by Flower's SuperExec, simulation process and Ray)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self.process: subprocess.Popen[bytes] | None = None

    def start_if_needed(self) -> bool:
        """Start a SuperLink where ``flwr run`` would start one; whether one was started."""
        from flwr.supercore.utils import get_flwr_home

        ports = _local_ports()
        if ports is None or _answers(ports[0]):
            return False
        http_port, control = ports
        folder = get_flwr_home() / "local-superlink"
        folder.mkdir(parents=True, exist_ok=True)
        env = {**environment(), OWNER_VARIABLE: self.token, "FLWR_DISABLE_UPDATE_CHECK": "1"}
        # The command of flwr/cli/local_superlink.py, so that `flwr run` finds it as its own.
        self.process = subprocess.Popen(
            [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation",
             "subprocess", "--control-api-address", control, "--host", "127.0.0.1", "--port",
             http_port, "--log-file", str(folder / "superlink.log"), "--database",
             str(folder / "state.db")], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(http_port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SettingsError(f"the local SuperLink did not start (see "
                                    f"{folder / 'superlink.log'})")
            time.sleep(0.5)
        print(f"fedgc: started a local SuperLink on 127.0.0.1:{http_port} for this run "
              f"(stopped after it)", flush=True)
        return True

    def leftovers(self) -> list[int]:
        """Ids of the running processes this SuperLink started (itself included)."""
        mark = f"{OWNER_VARIABLE}={self.token}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile, or another user's
                continue
        return found

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (SIGKILL after half of ``timeout_s``) to the SuperLink and every process it
        started, until none has been left for 2 s: Ray's raylet restarts an agent that ends
        before it does."""
        if self.process is None:
            return
        started = time.monotonic()
        quiet_since: float | None = None
        while time.monotonic() - started < timeout_s:
            left = self.leftovers()
            if left:
                quiet_since = None
                late = time.monotonic() - started > timeout_s / 2
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= 2.0:
                break
            time.sleep(0.3)
        self.process.wait(timeout=timeout_s)
        self.process = None


def run_status(run_id: str, env: Mapping[str, str]) -> tuple[str, str]:
    """Flower's (status, reason) of ``run_id``, once it is finished (or after
    :data:`STATUS_TIMEOUT_S`)."""
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    status, details = "unknown", ""
    while time.monotonic() < deadline:
        out = subprocess.run([_bin("flwr"), "ls", "--run-id", run_id, "--format", "json"],
                             capture_output=True, text=True, env=dict(env), timeout=60)
        try:
            runs = json.loads(out.stdout).get("runs", [])
        except json.JSONDecodeError:
            runs = []
        if runs:
            status, details = runs[0].get("status", status), runs[0].get("status-details", "")
            if status.startswith("finished"):
                break
        time.sleep(1.0)
    return status, details


def cmd_flwr(values: Mapping[str, object], verbose: bool = False) -> int:
    """Check ``values``, run them with ``flwr run`` on the project's staged app
    (:func:`simulations.flwr_app.staged_app`), return the run's exit status."""
    config, given = run_overrides(values)
    env = environment()
    print(f"fedgc: flwr run {PROJECT} with num-supernodes={config.train.num_clients} -> "
          f"{config.run_dir}", flush=True)
    link = LocalSuperLink()
    run_id = None
    try:
        # Staged before the SuperLink starts: an app Flower refuses starts nothing.
        with staged_app(PROJECT) as app:
            link.start_if_needed()
            command = flwr_command(app, given, config.train.num_clients, verbose)
            proc = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                if run_id is None and (m := re.search(r"Successfully started run (\d+)",
                                                      line)):
                    run_id = m.group(1)
            code = proc.wait()
        if run_id is None:
            print(f"python -m simulations flwr: flwr run started no run (exit status {code})",
                  file=sys.stderr)
            return code or 1
        status, details = run_status(run_id, env)
    except AppPathDepthError as ex:  # what `flwr run` says of the app too, in one line
        print(f"python -m simulations flwr: {ex}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if run_id is not None:
            subprocess.run([_bin("flwr"), "stop", run_id], env=env, capture_output=True,
                           timeout=60)
        print(f"python -m simulations flwr: interrupted; run {run_id or '(none yet)'} "
              f"stopped", file=sys.stderr)
        return 130
    finally:
        link.stop()
    if status != "finished:completed":
        print(f"python -m simulations flwr: run {run_id} {status}: {details}", file=sys.stderr)
        return 1
    summary = config.run_dir / "summary.json"
    if summary.exists():
        print(summary_table({config.method.title: json.loads(summary.read_text())}))
    print(f"results: {config.run_dir}/rounds.csv, summary.json (run {run_id}, {status})")
    return 0

