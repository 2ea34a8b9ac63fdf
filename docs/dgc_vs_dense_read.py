"""The readings of docs/dgc_vs_dense.md that ``python -m simulations traffic`` does not print.

Each reads finished run folders (``rounds.csv``, ``clients.csv``) of ``compare --seeds``
comparisons, laid out as ``FOLDER/seed-S/METHOD``, and prints a markdown table::

    python docs/dgc_vs_dense_read.py budgets FOLDER 1,3,10,25
    python docs/dgc_vs_dense_read.py horizon LONG SHORT 200,400,600
    python docs/dgc_vs_dense_read.py emulator FOLDER 200
    python docs/dgc_vs_dense_read.py falls RUN_FOLDER...

``budgets``: each compressed method's last-10 accuracy within a budget of total payload bytes
(MB), the mean over the seeds (``simulations.compare.accuracy_at_budget``: past its own final
bytes a method stays at its end). ``horizon``: each method's last-10 at the given rounds of the
long comparison LONG, and the round and payload bytes at which its last-10 first reaches the
last-10 of the same seed's dense run in SHORT (``simulations.compare.reach``). ``emulator``:
under the network emulator, the round, virtual seconds and payload bytes at which a run's
last-10 first reaches its seed's dense last-10 at the given round; its dips (rounds after the
50th more than 8 points below the round before); and the share of aggregated replies whose
client folded back an update the server did not aggregate (``restored``), in the dip rounds and
over the run. ``falls``: issue 37's dip metric for single run folders: a run's worst fall, the
largest drop of a round's accuracy below the best of the 10 rounds before it, after round 30
(with its round), the rounds more than 5 points below that best, the last-10, and the share of
aggregated replies that folded an unaggregated update back (``restored``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
from pathlib import Path

from simulations.compare import accuracy_at_budget, compressed_methods, reach, traffic_curve


def _seeds(folder: Path) -> list[Path]:
    seeds = sorted(folder.glob("seed-*"))
    if not seeds:
        raise SystemExit(f"{folder}: no seed-* folders (a compare --seeds comparison)")
    return seeds


def _methods(seed: Path) -> list[str]:
    return sorted(p.name for p in seed.iterdir() if (p / "rounds.csv").exists())


def _last10(curve: list[tuple[float, float]], rounds: int) -> float:
    return statistics.fmean(a for _, a in curve[rounds - 10:rounds])


def budgets(folder: Path, megabytes: list[float]) -> None:
    seeds = _seeds(folder)
    methods = compressed_methods(_methods(seeds[0]))
    print("| method | " + " | ".join(f"{b:g} MB" for b in megabytes) + " |")
    print("|---|" + "---|" * len(megabytes))
    for m in methods:
        curves = [traffic_curve(seed / m) for seed in seeds]
        row = [statistics.fmean(accuracy_at_budget(c, mb * 1e6) for c in curves)
               for mb in megabytes]
        print(f"| {m} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


def horizon(long: Path, short: Path, at: list[int]) -> None:
    print("| method | seed | " + " | ".join(f"last-10 @{n}" for n in at)
          + " | payload MB at end | reaches dense's last-10 at round | at payload MB |")
    print("|---|---|" + "---|" * len(at) + "---|---|---|")
    for seed in _seeds(long):
        dense = traffic_curve(short / seed.name / "dense")
        target = _last10(dense, len(dense))
        for m in _methods(seed):
            c = traffic_curve(seed / m)
            r, b = reach(c, target)
            hit = f"{r:.0f} | {b / 1e6:.1f}" if r == r else "never | -"
            cells = " | ".join(f"{_last10(c, n):.4f}" if len(c) >= n else "-" for n in at)
            print(f"| {m} | {seed.name[5:]} | {cells} | {c[-1][0] / 1e6:.1f} | {hit} |")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def emulator(folder: Path, target_round: int) -> None:
    print(f"| method | seed | last-10 @{target_round} | at end (rounds) | reaches dense's: round"
          " / virtual s / payload MB | dips | folded-back replies in dip rounds / overall |")
    print("|---|---|---|---|---|---|---|")
    for seed in _seeds(folder):
        target = _last10(traffic_curve(seed / "dense"), target_round)
        for m in _methods(seed):
            curve = traffic_curve(seed / m)
            acc = [a for _, a in curve]
            clock = itertools.accumulate(float(r["virtual_seconds"])
                                         for r in _rows(seed / m / "rounds.csv"))
            hit_round, hit_bytes = reach(curve, target)
            _, hit_seconds = reach(list(zip(clock, acc, strict=True)), target)
            hit = (f"{hit_round:.0f} / {hit_seconds:.0f} s / {hit_bytes / 1e6:.1f} MB"
                   if hit_round == hit_round else "never")
            dips = {i + 1 for i in range(50, len(acc)) if acc[i] < acc[i - 1] - 0.08}
            replies = [r for r in _rows(seed / m / "clients.csv") if r["status"] == "aggregated"]

            def folded(rows: list[dict[str, str]]) -> float:
                return sum(r["restored"] != "0" for r in rows) / max(1, len(rows))

            in_dips = [r for r in replies if int(r["round"]) in dips]
            print(f"| {m} | {seed.name[5:]} | {_last10(curve, target_round):.4f}"
                  f" | {_last10(curve, len(curve)):.4f} ({len(curve)}) | {hit}"
                  f" | {len(dips)} | {folded(in_dips):.2f} / {folded(replies):.2f} |")


def worst_fall(accuracy: list[float], after: int = 30, window: int = 10) -> tuple[float, int]:
    """The largest drop of a round's accuracy below the best of the ``window`` rounds before
    it, over the rounds after round ``after`` (1-based), and that round (0: none after it)."""
    worst, at = 0.0, 0
    for i in range(max(after, window), len(accuracy)):
        fall = max(accuracy[i - window:i]) - accuracy[i]
        if fall > worst:
            worst, at = fall, i + 1
    return worst, at


def falls(runs: list[Path]) -> None:
    print("| run | worst fall (points) @ round | rounds > 5 points below | last-10 |"
          " folded-back replies |")
    print("|---|---|---|---|---|")
    for run in runs:
        acc = [float(r["accuracy"]) for r in _rows(run / "rounds.csv")]
        worst, at = worst_fall(acc)
        below = sum(max(acc[i - 10:i]) - acc[i] > 0.05 for i in range(30, len(acc)))
        replies = [r for r in _rows(run / "clients.csv") if r["status"] == "aggregated"]
        folded = sum(r["restored"] != "0" for r in replies) / max(1, len(replies))
        print(f"| {run.name} | {100 * worst:.1f} @ {at} | {below} |"
              f" {statistics.fmean(acc[-10:]):.4f} | {folded:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="reading", required=True)
    p = sub.add_parser("budgets")
    p.add_argument("folder", type=Path)
    p.add_argument("megabytes", type=lambda s: [float(x) for x in s.split(",")])
    p = sub.add_parser("horizon")
    p.add_argument("long", type=Path)
    p.add_argument("short", type=Path)
    p.add_argument("rounds", type=lambda s: [int(x) for x in s.split(",")])
    p = sub.add_parser("emulator")
    p.add_argument("folder", type=Path)
    p.add_argument("target_round", type=int, nargs="?", default=200)
    p = sub.add_parser("falls")
    p.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.reading == "budgets":
        budgets(args.folder, args.megabytes)
    elif args.reading == "horizon":
        horizon(args.long, args.short, args.rounds)
    elif args.reading == "falls":
        falls(args.runs)
    else:
        emulator(args.folder, args.target_round)


if __name__ == "__main__":
    main()
