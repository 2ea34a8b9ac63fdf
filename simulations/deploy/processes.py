"""Child processes in their own process groups: start, wait for readiness, stop within bounds."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import ProcessStartError
from .files import private_dir

_POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Block until a TCP connect to ``host:port`` succeeds, or raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise ProcessStartError(
                    f"nothing accepts connections on {host}:{port} after {timeout_s:.0f} s "
                    f"({err})"
                ) from err
            time.sleep(_POLL_S)


class ManagedProcess:
    """One child process, the leader of its own process group, logging to a file.

    Parameters
    ----------
    name : str
        Short label used in logs and errors.
    argv : Sequence[str]
        Command line.
    log_path : Path
        stdout and stderr go here (appended, so a restarted process keeps its history).
    env : Mapping[str, str], optional
        Full environment of the child; the parent's when omitted.
    netns : str, optional
        Run inside this network namespace (``ip netns exec`` replaces itself with the command,
        so the pid stays the child's).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        if netns is not None:
            self.argv = ["ip", "netns", "exec", netns, *self.argv]
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._strays: list[int] = []
        self._start_lock = threading.Lock()

    @property
    def pid(self) -> int:
        """Process id (also the process group id)."""
        if self._proc is None:
            raise ProcessStartError(f"{self.name}: not started")
        return self._proc.pid

    def start(self) -> ManagedProcess:
        """Start the process; a process that is already running is left alone."""
        with self._start_lock:  # two threads must never start two copies
            return self._start()

    def _start(self) -> ManagedProcess:
        if self.running():
            return self
        private_dir(self.log_path.parent)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                # What Flower writes (its home, the database, app folders) is the user's alone.
                umask=0o077,
            )
        return self

    def running(self) -> bool:
        """Whether the process has been started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        """Exit status, or None while running (or never started)."""
        return None if self._proc is None else self._proc.poll()

    def log_text(self, since_start: bool = True) -> str:
        """The log written by this process (since its latest start by default)."""
        if not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()
        if since_start:
            data = data[self._log_offset:]
        return data.decode("utf-8", errors="replace")

    def tail(self, chars: int = 2000) -> str:
        """The end of the log, for error messages."""
        return self.log_text()[-chars:]

    def wait_for_log(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Block until ``pattern`` (a regex) appears in the log since the latest start.

        Raises
        ------
        ProcessStartError
            When the process exits first or ``timeout_s`` passes; the message holds the log tail.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.log_text())
            if match:
                return match
            if not self.running():
                raise ProcessStartError(
                    f"{self.name} exited with status {self.returncode()} before logging "
                    f"{pattern!r}; log tail:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise ProcessStartError(
                    f"{self.name} did not log {pattern!r} within {timeout_s:.0f} s; "
                    f"log tail:\n{self.tail()}"
                )
            time.sleep(_POLL_S)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (children included)."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, as in a fault test."""
        if self._proc is not None:
            self._strays = descendants(self._proc.pid)
        self.signal_group(signal.SIGKILL)
        self._kill_strays()
        if self._proc is not None:
            self._proc.wait(timeout=10)
            self._wait_group_gone(10.0)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; return the exit status."""
        if self._proc is None:
            return None
        # Flower's SuperExec starts a session of its own; remember it to kill it too.
        self._strays = descendants(self._proc.pid)
        if self._proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self._proc.wait(timeout=10)
        # Children that outlived their leader (e.g. SuperExec workers) still share the group.
        self.signal_group(signal.SIGKILL)
        self._kill_strays()
        self._wait_group_gone(timeout_s)
        return self._proc.returncode

    def _kill_strays(self) -> None:
        for pid in self._strays:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def group_alive(self) -> bool:
        """Whether any process of the group, or a known stray child, still exists."""
        if self._proc is None:
            return False
        strays = [pid for pid in self._strays if _pgid_of(pid) is not None]
        try:
            os.killpg(self._proc.pid, 0)
        except ProcessLookupError:
            return bool(strays)
        except PermissionError:
            return True
        return True

    def _wait_group_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self.group_alive():
            pids = [
                entry for entry in os.listdir("/proc")
                if entry.isdigit() and _pgid_of(int(entry)) == self._proc.pid  # type: ignore[union-attr]
            ]
            raise ProcessStartError(
                f"{self.name}: process group {self.pid} still has pids {pids} after SIGKILL"
            )


def _parent_map() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # The command name may hold spaces and parentheses; the fields after the last ')' don't.
        fields = stat[stat.rindex(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children that left its process group included)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_map().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def process_args(pid: int) -> list[str]:
    """The command line of ``pid`` (empty when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def run_command(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    timeout_s: float,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a short command to completion in its own process group, killing it on timeout."""
    with subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        text=True,
        start_new_session=True,
        umask=0o077,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise ProcessStartError(
                f"{' '.join(argv[:3])} ... did not finish within {timeout_s:.0f} s; "
                f"output tail:\n{out[-2000:]}"
            ) from None
        except BaseException:
            # Interrupted (a signal): the command must not outlive its caller.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, None)
