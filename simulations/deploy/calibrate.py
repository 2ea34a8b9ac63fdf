"""Calibration: one TCP transfer timed on the shaped real link against its analytic prediction.

The transfer is timed from the moment the payload (uplink) or the request for it (downlink) is
sent until the last byte is acknowledged or received, on a connection already set up through the
link. Both directions therefore take one round trip plus the serialisation of the payload, which
is what the virtual-clock emulator charges: ``rtt_s + payload_bytes * 8 / (bandwidth_mbps * 1e6)``.
Outages are switched off here: they are a separate, random process (see ``docs/deploy.md``).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import DeployError
from .links import LinkSet
from .presets import LinkSpec

_HEADER = struct.Struct("!cQ")
_IO_TIMEOUT_S = 120.0


def predicted_transfer_s(spec: LinkSpec, payload_bytes: int, direction: str) -> float:
    """Analytic transfer time: one round trip plus the payload at the direction's rate."""
    mbps = spec.up_mbps if direction == "up" else spec.down_mbps
    return spec.rtt_ms / 1000.0 + payload_bytes * 8.0 / (mbps * 1e6)


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured transfer and its prediction."""

    preset: str
    mode: str
    direction: str
    payload_bytes: int
    measured_s: float
    predicted_s: float

    @property
    def relative_error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_s - self.predicted_s) / self.predicted_s


def _recv_exact(sock: socket.socket, nbytes: int) -> None:
    remaining = nbytes
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 16))
        if not chunk:
            raise DeployError(f"connection closed with {remaining} of {nbytes} bytes unread")
        remaining -= len(chunk)


class TransferSink:
    """A loopback TCP server for calibration transfers (one thread per connection)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> TransferSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _handle(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_IO_TIMEOUT_S)
            try:
                header = b""
                while len(header) < _HEADER.size:
                    part = conn.recv(_HEADER.size - len(header))
                    if not part:
                        return
                    header += part
                direction, nbytes = _HEADER.unpack(header)
                conn.sendall(b"R")
                if direction == b"U":
                    _recv_exact(conn, nbytes)
                    conn.sendall(b"A")
                else:
                    _recv_exact(conn, 1)
                    conn.sendall(b"\0" * nbytes)
            except (OSError, DeployError):
                return  # the link dropped the connection; the client sees the failure


def time_transfer(host: str, port: int, payload_bytes: int, direction: str) -> float:
    """Time one transfer of ``payload_bytes`` through ``host:port`` (a sink behind a link)."""
    if direction not in ("up", "down"):
        raise DeployError(f"direction {direction!r} unknown, expected 'up' or 'down'")
    if payload_bytes <= 0:
        raise DeployError(f"payload_bytes={payload_bytes}, expected > 0")
    with socket.create_connection((host, port), timeout=_IO_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_HEADER.pack(b"U" if direction == "up" else b"D", payload_bytes))
        _recv_exact(sock, 1)
        start_s = time.perf_counter()
        if direction == "up":
            sock.sendall(b"\0" * payload_bytes)
            _recv_exact(sock, 1)
        else:
            sock.sendall(b"G")
            _recv_exact(sock, payload_bytes)
        return time.perf_counter() - start_s


def _time_in_netns(netns: str, host: str, port: int, payload_bytes: int, direction: str) -> float:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = ["ip", "netns", "exec", netns, sys.executable, "-m", "simulations.deploy.calibrate",
            host, str(port), str(payload_bytes), direction]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=_IO_TIMEOUT_S)
    if proc.returncode != 0:
        raise DeployError(f"transfer in {netns} failed: {proc.stderr.strip()[-1000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def measure(
    spec: LinkSpec,
    mode: str,
    payload_bytes: int,
    direction: str,
    seed: int = 0,
    repeats: int = 1,
) -> CalibrationPoint:
    """Shape one link in ``mode`` (resolved), time a transfer over it, and tear it down.

    With ``repeats > 1`` the fastest of that many transfers is kept: a busy machine can only make
    a transfer slower than its link allows, never faster, so the minimum is the link's own time.
    """
    if repeats < 1:
        raise DeployError(f"repeats={repeats}, expected >= 1")
    steady = spec.with_overrides(mean_offline_s=0.0)
    links = LinkSet(steady, mode, seed=seed)
    with TransferSink() as sink:
        try:
            link = links.build(0, "127.0.0.1", sink.port)
            host, port = link.address.rsplit(":", 1)
            times_s = []
            for _ in range(repeats):
                if link.netns is None:
                    times_s.append(time_transfer(host, int(port), payload_bytes, direction))
                else:
                    times_s.append(
                        _time_in_netns(link.netns, host, int(port), payload_bytes, direction)
                    )
            measured_s = min(times_s)
        finally:
            links.stop()
    return CalibrationPoint(spec.name, links.mode, direction, payload_bytes, measured_s,
                            predicted_transfer_s(steady, payload_bytes, direction))


def point_to_dict(point: CalibrationPoint) -> dict[str, object]:
    """A JSON-ready row, relative error included."""
    return {**asdict(point), "relative_error": point.relative_error}


if __name__ == "__main__":
    # Client side of a calibration transfer, run inside a SuperNode's namespace.
    _host, _port, _nbytes, _direction = sys.argv[1:5]
    print(json.dumps(time_transfer(_host, int(_port), int(_nbytes), _direction)))
