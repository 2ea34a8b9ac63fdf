"""The wire ledger of a run: bytes per client-round, per idle minute and per node, by category.

``summarize`` turns the exchanges of every node's link into ``wire.json`` (written into the run
folder); ``format_table`` prints it. ``python -m simulations wire RUN_DIR`` prints it again.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import WireError
from .ledger import CATEGORIES, DIRECTIONS, Attribution, Exchange, add, empty

#: The kinds of exchange that make one client-round (its train message and its reply).
ROUND_KINDS = ("train-down", "train-up")
IDLE_KINDS = ("poll", "heartbeat")
WIRE_FILE = "wire.json"


def _sum(exchanges: Sequence[Exchange]) -> list[dict[str, int]]:
    out = [empty(), empty()]
    for x in exchanges:
        for d in (0, 1):
            add(out[d], x.bytes[d])
    return out


def _scaled(parts: Sequence[Mapping[str, float]], factor: float) -> dict[str, dict[str, float]]:
    return {name: {k: v * factor for k, v in parts[d].items()}
            for d, name in enumerate(DIRECTIONS)}


def _interval_s(runs: list[list[float]], longest_s: float) -> float | None:
    """Median spacing of consecutive events within each run of events, closer than
    ``longest_s`` (None when too few)."""
    gaps = [b - a for times in runs for a, b in zip(times, times[1:], strict=False)
            if 0 < b - a < longest_s]
    return statistics.median(gaps) if gaps else None


def _idle_times(exchanges: Sequence[tuple[int, Exchange]], node: int,
                kind: str) -> list[list[float]]:
    """Start times of a node's ``kind`` exchanges; polls are cut into runs wherever a message
    (not a poll or heartbeat) was moved in between."""
    runs: list[list[float]] = [[]]
    for x in sorted((x for n, x in exchanges if n == node and math.isfinite(x.t_start)),
                    key=lambda x: x.t_start):
        if x.kind == kind:
            runs[-1].append(x.t_start)
        elif kind == "poll" and x.kind not in IDLE_KINDS and runs[-1]:
            runs.append([])  # heartbeats go on while a node works; polls stop
    return runs


def summarize(nodes: Mapping[int, Sequence[Attribution]], protocol: str,
              meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ledger of a run from each node's attributed connections (see the module docstring).

    Per client-round: the exchanges of its train message and its reply; "later rounds" leave
    out each node's first round (its first model and config). Idle per minute: a
    poll's and a heartbeat's mean bytes, times how many of each a minute holds at the intervals
    measured on the link. Per node: registration, activation, run and app-bundle fetches.
    """
    exchanges = [(node, x) for node, atts in nodes.items() for a in atts for x in a.exchanges]
    captured = [sum(a.wire_bytes[d] for atts in nodes.values() for a in atts) for d in (0, 1)]
    unattributed = [sum(a.unattributed[d] for atts in nodes.values() for a in atts)
                    for d in (0, 1)]
    missed = [sum(a.missed[d] for atts in nodes.values() for a in atts) for d in (0, 1)]
    rounds = sorted({(node, x.round) for node, x in exchanges if x.kind in ROUND_KINDS})
    per_round = _sum([x for _, x in exchanges if x.kind in ROUND_KINDS])
    # A node's first round carries what it learns once (a first model, a first config).
    first = {node: min((r for n, r in rounds if n == node and r is not None), default=None)
             for node in nodes}
    later = [(n, r) for n, r in rounds if r is not None and r != first.get(n)]
    per_later = _sum([x for n, x in exchanges if x.kind in ROUND_KINDS
                      and x.round is not None and x.round != first.get(n)])
    idle: dict[str, Any] = {}
    idle_minute = [dict.fromkeys(CATEGORIES, 0.0), dict.fromkeys(CATEGORIES, 0.0)]
    # The median spacing of consecutive events of a kind with no message moved between them
    # (a node does not poll while it works on a message).
    for kind, longest_s in (("poll", 600.0), ("heartbeat", 600.0)):
        picked = [(node, x) for node, x in exchanges if x.kind == kind]
        intervals = [_interval_s(_idle_times(exchanges, node, kind), longest_s)
                     for node in nodes]
        known = [i for i in intervals if i is not None]
        interval = statistics.median(known) if known else None
        if interval is None:  # too few idle stretches captured: the interval the run set
            interval = dict(meta or {}).get(f"{kind}_interval_s")
        mean = _sum([x for _, x in picked])
        idle[kind] = {"count": len(picked), "interval_s": interval,
                      "bytes_each": _scaled(mean, 1 / len(picked) if picked else 0.0)}
        if picked and interval:
            for d in (0, 1):
                for k in CATEGORIES:
                    idle_minute[d][k] += mean[d][k] / len(picked) * 60.0 / interval
    other: dict[str, Any] = {}
    for kind in sorted({x.kind for _, x in exchanges}
                       - set(ROUND_KINDS) - set(IDLE_KINDS) - {"setup"}):
        picked = [x for _, x in exchanges if x.kind == kind]
        messages = len({(n, x.round, x.kind) for n, x in exchanges if x.kind == kind})
        other[kind] = {"messages": messages,
                       "bytes_each": _scaled(_sum(picked), 1 / max(1, messages))}
    n_rounds = len(rounds)
    total = _sum([x for _, x in exchanges])
    payload = {name: total[d]["payload"] for d, name in enumerate(DIRECTIONS)}
    coverage = [1.0 - unattributed[d] / captured[d] if captured[d] else 1.0 for d in (0, 1)]
    return {
        "protocol": protocol,
        **dict(meta or {}),
        "nodes": len(nodes),
        "client_rounds": n_rounds,
        "captured_bytes": dict(zip(DIRECTIONS, captured, strict=True)),
        "payload_bytes": payload,
        "unattributed_bytes": dict(zip(DIRECTIONS, unattributed, strict=True)),
        "missed_bytes": dict(zip(DIRECTIONS, missed, strict=True)),
        "attributed_fraction": dict(zip(DIRECTIONS, coverage, strict=True)),
        "per_client_round": _scaled(per_round, 1 / n_rounds if n_rounds else 0.0),
        "later_client_rounds": len(later),
        "per_later_client_round": _scaled(per_later, 1 / len(later) if later else 0.0),
        "idle_per_minute": _scaled(idle_minute, 1.0),
        "idle": idle,
        "setup_per_node": _scaled(_sum([x for _, x in exchanges if x.kind == "setup"]),
                                  1 / max(1, len(nodes))),
        "other_messages": other,
        "whole_run_per_client_round": _scaled(total, 1 / n_rounds if n_rounds else 0.0),
        "secagg_stages": secagg_stages(exchanges),
        "timeline": timeline(exchanges),
        "messages": message_rows(exchanges),
    }


#: The secure-aggregation stages sent as messages of their own (``query.secagg``); the masked
#: vector's stage rides in the train message and its reply.
SECAGG_OWN_STAGES = ("setup", "share_keys", "unmask")


def secagg_stages(exchanges: Sequence[tuple[int, Exchange]]) -> dict[str, Any]:
    """Per secure-aggregation stage (``privacy.secagg``; empty without it): its messages (a
    request or a reply each) and every byte of their exchanges, per direction and category;
    ``exchange_bytes``: the wire bytes of the stages sent as messages of their own, what the
    emulator charges as ``exchange_wire_*_bytes`` (:mod:`simulations.netem.stages`)."""
    staged = [(n, x) for n, x in exchanges if "secagg_stage" in x.detail]
    out: dict[str, Any] = {}
    for stage in sorted({str(x.detail["secagg_stage"]) for _, x in staged}):
        picked = [(n, x) for n, x in staged if x.detail["secagg_stage"] == stage]
        out[stage] = {"messages": len({(n, x.detail.get("message")) for n, x in picked}),
                      "bytes": _scaled(_sum([x for _, x in picked]), 1.0)}
    if out:
        own = _sum([x for _, x in staged if x.detail["secagg_stage"] in SECAGG_OWN_STAGES])
        out["exchange_bytes"] = {name: sum(own[d].values())
                                 for d, name in enumerate(DIRECTIONS)}
    return out


#: RPCs that move one object of a message (SuperNode path).
_OBJECT_RPCS = ("PullObject", "PushObject")


def message_rows(exchanges: Sequence[tuple[int, Exchange]]) -> list[dict[str, Any]]:
    """Per message moved (node, round, kind): its RPCs, objects, payload, fedgc content and
    bytes per direction: what :mod:`simulations.netem.protocol` is calibrated from (on the
    payload: the rest of fedgc's content is nearly the same in every message, so it joins the
    protocol's fixed bytes)."""
    out: dict[tuple[int, int | None, str], dict[str, Any]] = {}
    for node, x in exchanges:
        if x.kind in IDLE_KINDS or x.kind in ("setup", "other") or x.round is None:
            continue
        row = out.setdefault((node, x.round, x.kind), {
            "node": node, "round": x.round, "kind": x.kind, "rpcs": 0, "objects": 0,
            "content": {"up": 0, "down": 0}, "fedgc": {"up": 0, "down": 0},
            "bytes": {"up": 0, "down": 0}})
        row["rpcs"] += 1
        row["objects"] += int(x.rpc in _OBJECT_RPCS)
        for d, name in enumerate(DIRECTIONS):
            row["content"][name] += x.bytes[d]["payload"]
            row["fedgc"][name] += x.bytes[d]["fedgc"]
            row["bytes"][name] += x.total(d)
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1] or 0, k[2]))]


def timeline(exchanges: Sequence[tuple[int, Exchange]]) -> list[dict[str, Any]]:
    """Per (node, round): when its train message's download and its reply's upload began and
    ended on the link, and the ClientApp's runtime as the SuperNode reported it."""
    spans: dict[tuple[int, int], dict[str, Any]] = {}
    for node, x in exchanges:
        # The ClientApp confirms receipt when it starts: start-up time, not transfer time.
        if (x.kind not in ROUND_KINDS or x.round is None or not math.isfinite(x.t_start)
                or x.rpc == "ConfirmMessageReceived"):
            continue
        row = spans.setdefault((node, x.round), {"node": node, "round": x.round})
        side = "down" if x.kind == "train-down" else "up"
        row[f"{side}_start"] = min(row.get(f"{side}_start", x.t_start), x.t_start)
        row[f"{side}_end"] = max(row.get(f"{side}_end", x.t_end), x.t_end)
        row[f"{side}_exchanges"] = row.get(f"{side}_exchanges", 0) + 1
        if "clientapp_runtime_s" in x.detail:
            row["clientapp_runtime_s"] = float(x.detail["clientapp_runtime_s"])  # type: ignore[arg-type]
    return [spans[k] for k in sorted(spans)]


def _row(name: str, cols: Sequence[Mapping[str, Mapping[str, float]]], key: str | None) -> str:
    cells = []
    for col in cols:
        for d in DIRECTIONS:
            part = col.get(d, {})
            value = sum(part.values()) if key is None else part.get(key, 0.0)
            if key == "beyond":
                value = sum(part.values()) - part.get("payload", 0.0)
            cells.append(f"{value:>10,.0f}")
    return f"{name:<16}" + "".join(cells)


def format_table(summary: Mapping[str, Any]) -> str:
    """The ledger as a text table (bytes; up and down per column group)."""
    cols = [summary["per_client_round"], summary.get("per_later_client_round", {}),
            summary["idle_per_minute"], summary["setup_per_node"],
            summary["whole_run_per_client_round"]]
    names = ["per client-round", "later rounds", "idle per minute", "setup per node",
             "all / client-round"]
    lines = [
        f"where the bytes go ({summary['protocol']}): {summary['nodes']} nodes, "
        f"{summary['client_rounds']} client-rounds, link {summary.get('link') or 'none'}, "
        f"TLS {'on' if summary.get('tls') else 'off'}; bytes on the link (IP)",
        " " * 16 + "".join(f"{n:>20}" for n in names),
        " " * 16 + "".join(f"{'up':>10}{'down':>10}" for _ in names),
    ]
    labels = {"payload": "payload", "fedgc": "fedgc content", "flower": "flower",
              "http": "http framing" if summary["protocol"] == "supernode" else "grpc+http2",
              "tls": "tls", "tcpip": "tcp/ip"}
    for key in CATEGORIES:
        lines.append(_row(labels[key], cols, key))
    lines.append(_row("total", cols, None))
    lines.append(_row("beyond payload", cols, "beyond"))
    idle = summary.get("idle", {})
    notes = []
    for kind in IDLE_KINDS:
        info = idle.get(kind)
        if info and info.get("interval_s"):
            notes.append(f"{kind} every {info['interval_s']:.1f} s")
    cap, una = summary["captured_bytes"], summary["unattributed_bytes"]
    frac = summary["attributed_fraction"]
    lines.append(f"captured {cap['up']:,} B up, {cap['down']:,} B down; attributed "
                 f"{frac['up']:.2%} up, {frac['down']:.2%} down (unattributed {una['up']:,} / "
                 f"{una['down']:,} B)" + (f"; {', '.join(notes)}" if notes else ""))
    missed = summary.get("missed_bytes", {})
    if any(missed.values()):
        lines.append(f"the capture missed {missed['up']:,} B up, {missed['down']:,} B down "
                     f"(packets the kernel dropped before tcpdump read them)")
    if "payload_clients_csv" in summary:
        csv_bytes, seen = summary["payload_clients_csv"], summary["payload_bytes"]
        lines.append(f"payload on the link {seen['up']:,} B up, {seen['down']:,} B down; "
                     f"clients.csv {csv_bytes['up']:,} / {csv_bytes['down']:,} B")
    stages = summary.get("secagg_stages") or {}
    if stages:
        parts = [f"{name} {sum(stages[name]['bytes']['up'].values()):,.0f} / "
                 f"{sum(stages[name]['bytes']['down'].values()):,.0f} B "
                 f"({stages[name]['messages']} messages)"
                 for name in stages if name != "exchange_bytes"]
        lines.append("secure aggregation on the wire (up / down): " + "; ".join(parts))
    return "\n".join(lines)


def write_wire(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Write ``wire.json`` into ``run_dir``."""
    path = Path(run_dir) / WIRE_FILE
    path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_wire(path: Path) -> dict[str, Any]:
    """``wire.json`` of a run folder (or the file itself).

    Raises
    ------
    WireError
        Missing, not JSON, or without the ledger's fields.
    """
    path = Path(path)
    if path.is_dir():
        path = path / WIRE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise WireError(f"{path}: cannot read the wire ledger ({err.strerror}); run the "
                        f"deployment with --capture") from None
    except ValueError as err:
        raise WireError(f"{path}: not JSON ({err})") from None
    missing = [k for k in ("protocol", "per_client_round", "idle_per_minute", "captured_bytes")
               if not isinstance(data, dict) or k not in data]
    if missing:
        raise WireError(f"{path}: field {missing[0]!r} missing; expected a wire ledger written "
                        f"by deploy --capture")
    return data
