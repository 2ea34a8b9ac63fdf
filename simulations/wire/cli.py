"""``python -m simulations wire RUN_DIR ...``: print where each captured run's bytes went."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import WireError
from .report import format_table, read_wire


def main(argv: Sequence[str]) -> int:
    """Print the wire ledger (``wire.json``) of each run folder; 2 on a bad folder or file.

    ``bridge ...`` measures the phone bridge path instead (:mod:`.bridge_run`).
    """
    if argv and argv[0] == "bridge":
        from .bridge_run import main as bridge_main

        try:
            return bridge_main(argv[1:])
        except WireError as err:
            print(f"python -m simulations wire bridge: error: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(
        prog="python -m simulations wire",
        description="Print where the bytes of a run captured with `python -m simulations "
                    "deploy --capture` went: payload, fedgc, Flower, HTTP, TLS, TCP/IP, per "
                    "client-round, per idle minute and per node.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folders holding wire.json (or wire.json files)")
    args = parser.parse_args(list(argv))
    try:
        tables = [format_table(read_wire(run)) for run in args.runs]
    except WireError as err:
        print(f"python -m simulations wire: error: {err}", file=sys.stderr)
        return 2
    print("\n\n".join(tables))
    return 0
