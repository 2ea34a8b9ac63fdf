"""The deployment kit against careless use: private files and folders, signals, config values."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.deploy.certs import make_node_keys, make_tls
from simulations.deploy.errors import DeployError
from simulations.deploy.fedgc_app import write_app
from simulations.deploy.toml_values import format_config


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_created_0600_and_folders_0700_even_with_a_permissive_umask(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_chmod(self: Path, mode: int, **kw: object) -> None:
        raise AssertionError(f"{self} chmod-ed to {oct(mode)} after it was written")

    monkeypatch.setattr(pathlib.Path, "chmod", no_chmod)
    old = os.umask(0o002)
    try:
        tls = make_tls(tmp_path / "work" / "tls", ["127.0.0.1"])
        keys = make_node_keys(tmp_path / "work" / "keys", "node0")
        app = write_app(tmp_path / "work" / "app-1.0.0", {"rounds": 2})
        (tmp_path / "work" / "tls" / "server.key").write_bytes(b"stale")
        again = make_tls(tmp_path / "work" / "tls", ["127.0.0.1"])  # replaces the old files
    finally:
        os.umask(old)
    for key in (tls.server_key, keys.private_key, again.server_key):
        assert _mode(key) == 0o600, key
    assert again.server_key.read_bytes() != b"stale"
    for folder in (tmp_path / "work", tls.ca_cert.parent, keys.private_key.parent, app):
        assert _mode(folder) == 0o700, folder


def test_one_toml_formatter_refuses_non_finite_numbers() -> None:
    assert format_config({"a": 1, "b": 0.5, "c": True, "d": "x y"}) == 'a=1 b=0.5 c=true d="x y"'
    for bad in (float("inf"), float("nan")):
        with pytest.raises(DeployError, match="round_timeout_s=.*expected a finite number"):
            format_config({"round_timeout_s": bad})
    with pytest.raises(DeployError, match=r"k=\[1\]: expected bool, int, float or str"):
        format_config({"k": [1]})


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper has ended)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return status[status.rindex(")") + 2] != "Z"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in out.stdout.splitlines() if line.split()}


def _namespace_of(pid: int) -> str:
    out = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="needs root and iproute2 for the links' namespaces")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_deploy_killed_mid_run_tears_everything_down(tmp_path: Path, sig: int) -> None:
    """SIGTERM unwinds through the teardown; SIGKILL leaves it to the deployment's watchdog
    (issue 26 item 10: it left 7 processes and 2 namespaces running)."""
    from simulations.deploy.processes import descendants, process_args

    work, results = tmp_path / "work", tmp_path / "results"
    argv = [sys.executable, "-m", "simulations", "deploy", "--nodes", "2", "--link", "lte",
            "--shaping", "tbf", "--workdir", str(work), "--timeout-s", "600",
            "--set", "task=digits", "--set", "rounds=30", "--set", "seed=0",
            "--set", f"results_dir={results}", "--set", "run_name=killed"]
    log = (tmp_path / "deploy.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        rounds = results / "killed" / "rounds.csv"
        deadline = time.monotonic() + 400
        while not (rounds.exists() and len(rounds.read_text().splitlines()) >= 2):
            assert proc.poll() is None, (tmp_path / "deploy.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no round finished in 400 s"
            time.sleep(0.5)
        started = descendants(proc.pid)
        names = [" ".join(process_args(p)[:3]) for p in started]
        assert any("flower-superlink" in n for n in names), names
        assert sum("flower-supernode" in n for n in names) == 2, names
        assert any("flwr-serverapp" in n for n in names), names
        assert any("flower-superexec" in n or "flwr-superexec" in n for n in names), names
        # Other runs on this machine may hold namespaces too: ours are our SuperNodes'.
        ours = {_namespace_of(p) for p in started
                if "flower-supernode" in " ".join(process_args(p)[:2])}
        assert len(ours) == 2 and all(n.startswith("fedgc-") for n in ours), ours
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == (128 + sig if sig != signal.SIGKILL else -sig)
    finally:
        if proc.poll() is None:  # a failed check above: still tear the run down
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    text = (tmp_path / "deploy.log").read_text()
    if sig == signal.SIGKILL:  # the watchdog's sweep takes a moment
        deadline = time.monotonic() + 60
        while ([p for p in started if _alive(p)] or ours & _namespaces()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
    else:
        assert f"stopped by {signal.Signals(sig).name}" in text
    assert "Traceback" not in text
    assert [p for p in started if _alive(p)] == []
    leftover = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                if _alive(p) and str(work) in " ".join(process_args(p))]
    assert leftover == []
    assert not (ours & _namespaces())
    if sig == signal.SIGKILL:
        assert "killed" in (work / "logs" / "watchdog.log").read_text()
    # Everything the run wrote under --workdir is private to its user.
    for folder in [work, *[p for p in work.rglob("*") if p.is_dir()]]:
        assert _mode(folder) == 0o700, folder


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_unwinds_the_deploy_command_once(sig: int) -> None:
    from simulations.deploy.cli import _signals_unwind
    from simulations.deploy.errors import DeployInterrupted

    before = signal.getsignal(sig)
    with pytest.raises(DeployInterrupted) as stop, _signals_unwind():
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises long before this ends
    assert stop.value.signum == sig and signal.Signals(sig).name in str(stop.value)
    assert signal.getsignal(sig) is before  # the caller's handlers are back


def test_deploy_refuses_a_run_that_cannot_work_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.deploy.cli import main

    work = tmp_path / "work"
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = main(["--nodes", "2", "--workdir", str(work), "--set", "task=digits",
                 "--set", f"results_dir={tmp_path}", "--set", f"state_dir={blocker / 's'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"state_dir {blocker / 's'} is not a writable folder" in err
    assert "Traceback" not in err and not work.exists()  # no SuperLink was started


def test_deploy_config_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.deploy.cli import main

    assert main(["--nodes", "2", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path} is a folder" in err and "Traceback" not in err


@pytest.mark.parametrize("option, words", [
    (["--timeout-s", "-5"], "--timeout-s -5: expected a finite number of seconds > 0"),
    (["--timeout-s", "nan"], "--timeout-s nan: expected a finite number"),
    (["--nodes", "0"], "--nodes 0: expected an integer in 1..200"),
    (["--workdir", "{file}"], "--workdir {file} is not a folder"),
])
def test_deploy_options_that_cannot_work_are_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], option: list[str], words: str) -> None:
    from simulations.deploy.cli import main

    afile = tmp_path / "a-file"
    afile.write_text("the user's")
    option = [o.format(file=afile) for o in option]
    code = main([*option, "--set", "task=digits", "--set", f"results_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words.format(file=afile) in err, err
    assert not (tmp_path / "r").exists() and afile.read_text() == "the user's"


_DEPLOYER = r"""
import os, subprocess, sys, time
from pathlib import Path
from simulations.deploy.watchdog import Watchdog, start_time
work, netns, clean = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "clean"
dog = Watchdog(work / "watchdog.json", work / "watchdog.log").start()
env = {**os.environ, "FLWR_HOME": str(work / "flwr-home")}
# A group leader with a child, as a SuperNode and its app process; and an escaped grandchild in
# a session of its own, as Flower's SuperExec (found by its environment only).
leader = subprocess.Popen(["sh", "-c", "sleep 1000 & setsid sleep 1001 & wait"], env=env,
                          start_new_session=True)
if netns:
    subprocess.run(["ip", "netns", "add", netns], check=True)
dog.record({"flwr_home": str(work / "flwr-home"), "namespaces": [netns] if netns else [],
            "processes": [{"pid": leader.pid, "start": start_time(leader.pid)}]})
print("READY", leader.pid, flush=True)
if clean:
    dog.stop()
    print("STOPPED", flush=True)
time.sleep(1000)
"""


def _sleepers(work: Path) -> list[int]:
    from simulations.deploy.watchdog import deployment_pids

    return sorted(deployment_pids({"flwr_home": str(work / "flwr-home")}))


@pytest.mark.parametrize("clean", [False, True])
def test_the_watchdog_tears_down_what_a_sigkilled_deploy_left(tmp_path: Path, clean: bool) -> None:
    """Issue 26 item 10: SIGKILL of `deploy` left 7 processes and 2 namespaces running."""
    netns = (f"fedgc-wdtest{os.getpid() % 10000}-0"
             if os.geteuid() == 0 and shutil.which("ip") else "")
    deployer = subprocess.Popen(
        [sys.executable, "-c", _DEPLOYER, str(tmp_path), netns, "clean" if clean else "kill"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert deployer.stdout.readline().startswith("READY")
        if clean:
            assert deployer.stdout.readline().startswith("STOPPED")
        deadline = time.monotonic() + 10
        while len(_sleepers(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = _sleepers(tmp_path)
        assert len(started) >= 3  # sh, its sleep, the escaped sleep
        deployer.kill()  # SIGKILL: no teardown runs in the deployer
        deployer.wait(timeout=10)
        log = tmp_path / "watchdog.log"
        deadline = time.monotonic() + 20
        while not clean and "killed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        if clean:  # a deployment that stopped cleanly is left alone (there is nothing left)
            time.sleep(1.0)
            assert _sleepers(tmp_path) == started
        else:
            assert _sleepers(tmp_path) == []
            if netns:
                assert netns not in _namespaces()
            assert "killed 3 processes, deleted " in log.read_text()
    finally:
        for pid in _sleepers(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if netns and netns in _namespaces():
            subprocess.run(["ip", "netns", "del", netns], check=False)
        if deployer.poll() is None:
            deployer.kill()
