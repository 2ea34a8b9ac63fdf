"""Packet capture on a node's link: Debian's ``tcpdump`` on the host end of its veth pair.

A capture records every packet the link carries, whole (``-s 0``), into a pcap file in the
deployment's private work folder; :mod:`simulations.wire` reads it back and splits the bytes into
payload, fedgc, Flower, HTTP, TLS and TCP/IP. With TLS the SuperNode's session secrets are
written next to it (``SSLKEYLOGFILE``, honoured by Python's ``ssl`` that Flower's HTTP client
uses), so that the records can be decrypted and attributed exactly: the pcap and its key file
together reveal the traffic, and both are created 0600 inside the 0700 work folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .errors import DeployError
from .files import private_dir

#: Seconds tcpdump gets to flush and exit after SIGINT.
_STOP_TIMEOUT_S = 10.0
#: Before SIGINT: how long the capture file must stay the same size, and the bound on waiting.
_SETTLE_POLL_S = 0.5
_SETTLE_TIMEOUT_S = 10.0


class CaptureError(DeployError):
    """A capture cannot start (no tcpdump, no namespaced link) or did not stop cleanly."""


def tcpdump_path() -> str | None:
    """Where ``tcpdump`` is, or None (Debian: ``apt-get install tcpdump``; ``make`` does it)."""
    return shutil.which("tcpdump") or next(
        (p for p in ("/usr/bin/tcpdump", "/usr/sbin/tcpdump") if os.access(p, os.X_OK)), None)


def missing_reason() -> str | None:
    """Why a capture cannot run here (None when it can): not root, or no tcpdump."""
    if os.geteuid() != 0:
        return "packet capture needs root (tcpdump on the links' veth devices)"
    if tcpdump_path() is None:
        return "tcpdump not found (Debian: apt-get install tcpdump)"
    return None


class PacketCapture:
    """``tcpdump -i DEV -w PCAP`` of TCP traffic, started and stopped within bounds.

    Parameters
    ----------
    device : str
        The interface (the host end of a node's veth pair).
    pcap_path : Path
        Where the packets go (created 0600; its folder 0700).
    netns : str, optional
        Capture inside this network namespace instead of the root one.
    bpf_filter : str
        Which packets (tcpdump's filter expression; TCP by default).
    """

    def __init__(self, device: str, pcap_path: Path, netns: str | None = None,
                 bpf_filter: str = "tcp") -> None:
        self.device = device
        self.pcap_path = pcap_path
        self.netns = netns
        self.bpf_filter = bpf_filter
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = pcap_path.with_suffix(".tcpdump.log")

    def start(self, timeout_s: float = 10.0) -> PacketCapture:
        """Start tcpdump and wait until it says it is listening.

        Raises
        ------
        CaptureError
            When tcpdump is missing, exits, or does not start listening within ``timeout_s``.
        """
        why = missing_reason()
        if why is not None:
            raise CaptureError(why)
        private_dir(self.pcap_path.parent)
        # An empty 0600 file first: tcpdump then writes into it with our mode, never 0644.
        self.pcap_path.unlink(missing_ok=True)
        os.close(os.open(self.pcap_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        # -Z root: keep writing as root into the 0600 file (tcpdump drops to user tcpdump by
        # default, who could not write to it).
        # -B: a 32 MiB kernel buffer, so that a busy machine does not drop packets of a
        # dense model's burst before tcpdump reads them.
        argv = [str(tcpdump_path()), "-i", self.device, "-s", "0", "-U", "-n", "-B", "32768",
                "--immediate-mode", "-Z", "root", "-w", str(self.pcap_path),
                *self.bpf_filter.split()]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self._log.unlink(missing_ok=True)
        with os.fdopen(os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                       "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while b"listening on" not in self._log.read_bytes():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                text = self._log.read_text(errors="replace")[-1000:]
                self.stop()
                raise CaptureError(f"tcpdump on {self.device} did not start: {text.strip()}")
            time.sleep(0.05)
        return self

    def stop(self) -> int:
        """SIGINT (tcpdump flushes and prints its counts), SIGKILL after a bound; idempotent.

        Returns the number of packets tcpdump reported dropped by the kernel (0 when unknown).
        """
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            # tcpdump exits on SIGINT without writing what the kernel handed it but it has not
            # processed yet: let it catch up first (the file stops growing), within a bound.
            deadline = time.monotonic() + _SETTLE_TIMEOUT_S
            size = -1
            while time.monotonic() < deadline:
                now = self.pcap_path.stat().st_size if self.pcap_path.exists() else 0
                if now == size:
                    break
                size = now
                time.sleep(_SETTLE_POLL_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=_STOP_TIMEOUT_S)
        self._proc = None
        return dropped_by_kernel(self._log.read_text(errors="replace"))


def dropped_by_kernel(tcpdump_log: str) -> int:
    """``N packets dropped by kernel`` from tcpdump's closing lines (0 when absent)."""
    for line in tcpdump_log.splitlines():
        words = line.split()
        if line.endswith("packets dropped by kernel") and words and words[0].isdigit():
            return int(words[0])
    return 0
