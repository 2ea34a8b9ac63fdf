"""Tear a deployment down when the process that started it dies without doing so (SIGKILL).

SIGTERM and SIGINT unwind ``python -m simulations deploy`` through its teardown; SIGKILL does
not, and left the SuperLink, the SuperNodes, their app processes (7 processes) and the links'
network namespaces running. :class:`Watchdog` starts, before anything else of the deployment, a
small process of its own session that holds the read end of a pipe whose only write end the
deploying process holds: the kernel closes that end however the process ends, the watchdog's
read returns, and unless the deployment said it stopped cleanly (one byte first), the watchdog
kills every process of the deployment and deletes its namespaces (:func:`sweep`).

A process of the deployment is one that carries the deployment's ``FLWR_HOME`` in its
environment (every process the deployment starts, and what they start, inherit it), or one the
record names by pid and start time; the namespaces are the record's
(:meth:`Watchdog.record`, rewritten before each is created).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .processes import descendants

#: How long a sweep keeps killing what it finds (processes may start children meanwhile).
SWEEP_S = 15.0
_CLEAN_EXIT = b"x"


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot; tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return status[status.rindex(")") + 2] != "Z"


def deployment_pids(record: dict[str, object]) -> set[int]:
    """The live processes of the deployment ``record`` describes (never this process)."""
    me = os.getpid()
    found = set()
    for proc in record.get("processes", []):  # type: ignore[union-attr]
        pid, started = int(proc["pid"]), proc["start"]
        if start_time(pid) == started:
            found.add(pid)
            found.update(descendants(pid))
    entry = f"FLWR_HOME={record['flwr_home']}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me and _environ_has(int(name), entry):
            found.add(int(name))
    return {p for p in found if p != me and _alive(p)}


def sweep(record: dict[str, object]) -> dict[str, int]:
    """Kill every process of the deployment and delete its namespaces; return what it did."""
    killed: set[int] = set()
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        pids = deployment_pids(record)
        if not pids:
            break
        for pid in pids:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)
    deleted = 0
    for name in record.get("namespaces", []):  # type: ignore[union-attr]
        pids = subprocess.run(["ip", "netns", "pids", str(name)], capture_output=True,
                              text=True, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        gone = subprocess.run(["ip", "netns", "del", str(name)], capture_output=True,
                              check=False).returncode == 0
        deleted += gone
    return {"killed": len(killed), "namespaces_deleted": deleted}


class Watchdog:
    """The watchdog process of one deployment (see the module docstring).

    Parameters
    ----------
    record_path : Path
        Where the deployment's processes and namespaces are recorded (JSON, rewritten
        atomically by :meth:`record`).
    log_path : Path
        The watchdog's log.
    """

    def __init__(self, record_path: Path, log_path: Path) -> None:
        self.record_path = record_path
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_end: int | None = None

    def start(self) -> Watchdog:
        """Start the watchdog process (in its own session, so that a signal to the deploying
        process's group does not reach it)."""
        read_end, write_end = os.pipe()  # neither is inherited by other children (PEP 446)
        try:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "simulations.deploy.watchdog",
                     str(self.record_path), str(read_end)],
                    pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    cwd=Path(__file__).resolve().parents[2])
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._write_end = write_end
        return self

    def record(self, record: dict[str, object]) -> None:
        """Rewrite the record (atomically: the watchdog may read it at any moment)."""
        tmp = self.record_path.with_name(f".{self.record_path.name}.tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, self.record_path)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the watchdog the deployment stopped cleanly, and wait for it to exit."""
        if self._write_end is not None:
            with contextlib.suppress(OSError):
                os.write(self._write_end, _CLEAN_EXIT)
            os.close(self._write_end)
            self._write_end = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    @property
    def pid(self) -> int | None:
        """The watchdog process's pid (None when not running)."""
        return None if self._proc is None else self._proc.pid


def main(argv: list[str]) -> int:
    """``python -m simulations.deploy.watchdog RECORD FD``: wait on the pipe, sweep on EOF."""
    record_path, fd = Path(argv[0]), int(argv[1])
    # The deployment's own signals (Ctrl-C in its terminal) are for it, not for the watchdog.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            data = os.read(fd, 1)
            break
        except InterruptedError:
            continue
    if data == _CLEAN_EXIT:
        return 0
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as ex:
        print(f"watchdog: the deploying process died, but its record {record_path} cannot be "
              f"read ({ex}); nothing swept", flush=True)
        return 1
    done = sweep(record)
    print(f"watchdog: the deploying process died without stopping its deployment; killed "
          f"{done['killed']} processes, deleted {done['namespaces_deleted']} namespaces",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
