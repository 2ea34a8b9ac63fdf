"""Start Flower's ``flower-supernode`` in this process, with what fedgc's deployment adds to it.

``python -m simulations.deploy.launch supernode [--keylog FILE] -- <flower-supernode args>``

- ``--keylog FILE``: every TLS context the process creates logs its session secrets to ``FILE``
  (NSS key log format), so that :mod:`simulations.wire` can decrypt a capture of the node's link.
  Flower builds its client context with ``ssl.SSLContext(...)`` directly, which ignores the
  ``SSLKEYLOGFILE`` variable that only ``ssl.create_default_context`` reads.

Everything else is Flower's own command line, unchanged.
"""

from __future__ import annotations

import argparse
import ssl
import sys
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


def main(argv: Sequence[str]) -> int:
    """Apply the options, then run ``flower-supernode`` with the arguments after ``--``."""
    parser = argparse.ArgumentParser(prog="python -m simulations.deploy.launch")
    parser.add_argument("component", choices=["supernode"])
    parser.add_argument("--keylog", default=None, help="log TLS secrets here")
    args, rest = parser.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.keylog:
        log_tls_keys(args.keylog)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
