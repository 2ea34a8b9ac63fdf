"""Start Flower's ``flower-supernode`` or ``flower-superlink`` in this process, with the settings
fedgc's deployment adds to them (Flower 1.42 has no options for them).

``python -m simulations.deploy.launch supernode [--keylog FILE] [--poll-interval-s S]
[--heartbeat-interval-s S] -- <flower-supernode args>``
``python -m simulations.deploy.launch superlink [--keep-alive-s S] -- <flower-superlink args>``

- ``--keylog FILE``: every TLS context the process creates logs its session secrets to ``FILE``
  (NSS key log format), so that :mod:`simulations.wire` can decrypt a capture of the node's link.
  Flower builds its client context with ``ssl.SSLContext(...)`` directly, which ignores the
  ``SSLKEYLOGFILE`` variable that only ``ssl.create_default_context`` reads.
- ``--poll-interval-s``: how long an idle SuperNode sleeps between two ``PullMessages``
  (Flower: ``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``). Longer: fewer
  bytes and radio wake-ups while idle; a message waits on average half of it before it is
  pulled.
- ``--heartbeat-interval-s``: the interval a SuperNode announces and heartbeats at (Flower:
  ``HEARTBEAT_DEFAULT_INTERVAL`` = 30 s, sent every ~0.8 x (interval - 5 s)). The SuperLink
  marks a node offline 2 intervals after its last heartbeat, so a dead node is noticed later.
- ``--keep-alive-s``: how long an idle connection is kept open: by the SuperLink's HTTP server
  (uvicorn's ``timeout_keep_alive``) and by the SuperNode's HTTP client (httpx's
  ``keepalive_expiry``), both 5 s by default. Shorter than a node's poll interval, every poll
  opens a new TCP connection and, with TLS, a full handshake (Flower's client does not resume
  TLS sessions).

Everything else is Flower's own command line, unchanged. These patch module attributes of
``flwr`` 1.42; another Flower version is refused rather than patched blindly.
"""

from __future__ import annotations

import argparse
import math
import ssl
import sys
import time
from collections.abc import Sequence


def log_tls_keys(path: str) -> None:
    """Make every ``ssl.SSLContext`` created from now on log its secrets to ``path``."""
    base = ssl.SSLContext

    class KeyLoggingContext(base):  # type: ignore[misc, valid-type]
        """An SSLContext that logs its TLS secrets (measurement only)."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__()
            self.keylog_filename = path

    ssl.SSLContext = KeyLoggingContext  # type: ignore[misc]


#: The Flower release whose module attributes the options patch.
FLOWER_VERSION = "1.42.0"
#: The sleep of an idle SuperNode's loop in ``start_client_internal`` (Flower 1.42).
FLOWER_POLL_S = 3


class _PollClock:
    """``time`` for ``start_client_internal``: its idle-loop sleep lasts ``poll_s`` instead."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s

    def sleep(self, seconds: float) -> None:
        time.sleep(self.poll_s if seconds == FLOWER_POLL_S else seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def _check_flower() -> None:
    from importlib.metadata import version

    found = version("flwr")
    if found != FLOWER_VERSION:
        raise SystemExit(f"simulations.deploy.launch: flwr {found} installed; the poll, "
                         f"heartbeat and keep-alive options patch flwr {FLOWER_VERSION}")


def set_poll_interval(seconds: float) -> None:
    """An idle SuperNode pulls every ``seconds`` instead of every 3 s."""
    _check_flower()
    from flwr.supernode import start_client_internal

    start_client_internal.time = _PollClock(seconds)  # type: ignore[attr-defined]


def set_heartbeat_interval(seconds: float) -> None:
    """The SuperNode announces and heartbeats at ``seconds`` instead of 30 s."""
    _check_flower()
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]
    fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]


def set_client_keep_alive(seconds: float) -> None:
    """The SuperNode's HTTP client keeps idle connections ``seconds`` instead of 5 s (httpx's
    ``keepalive_expiry``): both ends must keep a connection for it to be reused."""
    _check_flower()
    import httpx

    base = httpx.Client

    class KeepAliveClient(base):  # type: ignore[misc, valid-type]
        """httpx.Client with a longer keep-alive for idle connections."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.setdefault("limits", httpx.Limits(max_connections=100,
                                                     max_keepalive_connections=20,
                                                     keepalive_expiry=seconds))
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    httpx.Client = KeepAliveClient  # type: ignore[misc]


def set_keep_alive(seconds: float) -> None:
    """The SuperLink's HTTP server keeps idle connections ``seconds`` instead of 5 s."""
    _check_flower()
    import uvicorn

    run = uvicorn.run

    def run_keeping_alive(*args: object, **kwargs: object) -> None:
        kwargs.setdefault("timeout_keep_alive", int(math.ceil(seconds)))
        run(*args, **kwargs)  # type: ignore[arg-type]

    uvicorn.run = run_keeping_alive


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def main(argv: Sequence[str]) -> int:
    """Apply the options, then run Flower's command with the arguments after ``--``."""
    parser = argparse.ArgumentParser(prog="python -m simulations.deploy.launch")
    parser.add_argument("component", choices=["supernode", "superlink"])
    parser.add_argument("--keylog", default=None, help="log TLS secrets here")
    parser.add_argument("--poll-interval-s", type=_seconds, default=None)
    parser.add_argument("--heartbeat-interval-s", type=_seconds, default=None)
    parser.add_argument("--keep-alive-s", type=_seconds, default=None)
    args, rest = parser.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.keylog:
        log_tls_keys(args.keylog)
    if args.poll_interval_s is not None:
        set_poll_interval(args.poll_interval_s)
    if args.heartbeat_interval_s is not None:
        set_heartbeat_interval(args.heartbeat_interval_s)
    if args.keep_alive_s is not None:
        if args.component == "superlink":
            set_keep_alive(args.keep_alive_s)
        else:
            set_client_keep_alive(args.keep_alive_s)
    if args.component == "superlink":
        from flwr.superlink.cli.flower_superlink import flower_superlink

        sys.argv = ["flower-superlink", *rest]
        flower_superlink()
        return 0
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
