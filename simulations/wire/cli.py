"""``python -m simulations wire RUN_DIR ...``: print where each captured run's bytes went."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulations.netem.protocol import calibrate

from .bridge_link import analyse_phone
from .bridge_run import main as bridge_main
from .errors import WireError
from .report import format_table, read_wire, summarize, write_wire
from .supernode import analyse_deployment
from .timing import round_split

#: Keys of ``wire.json`` that :func:`.report.summarize` computes (the rest describes the run).
_COMPUTED = ("protocol", "nodes", "client_rounds", "captured_bytes", "payload_bytes",
             "unattributed_bytes", "missed_bytes", "attributed_fraction", "per_client_round",
             "later_client_rounds", "per_later_client_round", "idle_per_minute", "idle",
             "setup_per_node", "other_messages", "whole_run_per_client_round", "timeline",
             "messages")


def reanalyse(run: Path, capture_dir: Path | None) -> dict[str, Any]:
    """Analyse a run's captures again (after the analysis changed) and rewrite its wire.json."""
    old = read_wire(run)
    folder = Path(capture_dir or old.get("capture_dir") or "")
    if not folder.is_dir():
        raise WireError(f"{run}: capture folder {str(folder) or '(not recorded)'} not found; "
                        f"pass --capture-dir")
    meta = {k: v for k, v in old.items() if k not in _COMPUTED}
    meta["capture_dir"] = str(folder)
    if old["protocol"] == "bridge":
        nodes = {i: analyse_phone(folder / f"phone{i}.pcap", folder / f"phone{i}.calls.json")
                 for i in range(int(old["nodes"]))}
    else:
        nodes = analyse_deployment(folder, int(old["nodes"]))
    summary = summarize(nodes, str(old["protocol"]), meta)
    write_wire(run, summary)
    return summary


def protocol_name(ledger: dict[str, Any]) -> str:
    """The emulator's name of a ledger's protocol: ``supernode`` or ``bridge``, then ``-tls``,
    then ``-phone`` for a SuperNode run with fedgc's poll, heartbeat or keep-alive settings."""
    tuned = any(ledger.get(k) for k in ("poll_interval_s", "heartbeat_interval_s",
                                        "keep_alive_s"))
    return (f"{ledger['protocol']}{'-tls' if ledger.get('tls') else ''}"
            f"{'-phone' if tuned else ''}")


def calibrate_main(argv: Sequence[str]) -> int:
    """Fit the emulator's protocol models from captured runs and write them as JSON."""
    import json

    parser = argparse.ArgumentParser(
        prog="python -m simulations wire calibrate",
        description="Fit simulations.netem.protocol models (per protocol and TLS) from the "
                    "wire ledgers of captured runs, and print or write them.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None, help="write the models here")
    args = parser.parse_args(list(argv))
    groups: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for run in args.runs:
        ledger = read_wire(run)
        groups.setdefault(protocol_name(ledger), []).append((run, ledger))
    models = {}
    for name, runs in sorted(groups.items()):
        splits = [row for run, ledger in runs for row in round_split(run, ledger)]
        models[name] = calibrate(name, [ledger for _, ledger in runs], splits).to_dict()
        models[name].pop("name")
        models[name]["source"] += ": " + ", ".join(run.name for run, _ in runs)
    text = json.dumps(models, indent=2) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def main(argv: Sequence[str]) -> int:
    """Print the wire ledger (``wire.json``) of each run folder; 2 on a bad folder or file.

    ``bridge ...`` measures the phone bridge path instead (:mod:`.bridge_run`).
    """
    if argv and argv[0] == "calibrate":
        try:
            return calibrate_main(argv[1:])
        except (WireError, ValueError) as err:
            print(f"python -m simulations wire calibrate: error: {err}", file=sys.stderr)
            return 2
    if argv and argv[0] == "bridge":
        try:
            return bridge_main(argv[1:])
        except WireError as err:
            print(f"python -m simulations wire bridge: error: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(
        prog="python -m simulations wire",
        description="Print where the bytes of a run captured with `python -m simulations "
                    "deploy --capture` (or `python -m simulations wire bridge`) went: payload, "
                    "fedgc, Flower, HTTP, TLS, TCP/IP, per client-round, per idle minute and "
                    "per node.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folders holding wire.json (or wire.json files)")
    parser.add_argument("--reanalyse", action="store_true",
                        help="analyse the run's captures again and rewrite its wire.json")
    parser.add_argument("--capture-dir", type=Path, default=None,
                        help="with --reanalyse and one run: where its captures are")
    args = parser.parse_args(list(argv))
    try:
        if args.reanalyse:
            summaries = [reanalyse(run, args.capture_dir) for run in args.runs]
        else:
            summaries = [read_wire(run) for run in args.runs]
    except WireError as err:
        print(f"python -m simulations wire: error: {err}", file=sys.stderr)
        return 2
    print("\n\n".join(format_table(s) for s in summaries))
    return 0
