"""What a comparison adds to its runs' summaries: ratios to the dense run, and seeds' mean/std.

``compare`` runs one scenario once per method (and, with ``--seeds``, once per seed). A run's
own ``*_compression`` keys compare it with what dense fp32 would have cost for the same
messages; in a comparison that includes ``dense``, :func:`against_dense` adds the ratio to the
dense run itself (``uplink_vs_dense`` and so on: dense bytes / the method's bytes, so 50.0 means
fifty times fewer). :func:`over_seeds` folds the per-seed summaries into a mean and a standard
deviation per method (``compare.json`` of ``compare --seeds``). :func:`at_equal_traffic` reads
each method's accuracy at the total traffic of the cheapest one (or of a method named), so that
methods that end at different byte counts are compared at the same budget; :func:`find_runs`
finds the run folders of a finished comparison, so that it can be read again at another budget
(``python -m simulations traffic``). :func:`traffic_area` gives the area under each method's
accuracy against log10 of its cumulative total bytes, up to its own final bytes;
:func:`curve_above` how much of the byte range each compressed method's curve is above every
other compressed method's. :func:`by_family`
orders a comparison's methods family by family (``fedgc.methods.Method.family``), as its tables
and plots list them. Under the network emulator :func:`at_target` reads each run's virtual
seconds, wire bytes and joules to the target accuracy (``netem.target_accuracy``, or derived
from the dense run) from its ``rounds.csv`` alone, whatever drove the run
(:mod:`simulations.netem.target`).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedgc import methods as registry
from fedgc.methods import baseline
from fedgc.settings import SettingsError
from server.results import LAST_ROUNDS, read_rounds
from simulations.netem.target import derived_target, reach_target

__all__ = ["AGGREGATED", "DIRECTIONS", "TO_TARGET", "against_dense", "at_equal_traffic",
           "at_target", "by_family",
           "check_regular", "compressed_methods", "curve_above", "family_of", "find_runs",
           "over_seeds", "parse_seeds", "reach", "read_summary", "traffic_area", "traffic_curve"]

#: The method every ratio of a comparison is taken against (dense FedAvg: the registry's
#: first ``baseline`` method).
BASELINE = baseline()
#: ``<direction>_bytes`` keys of a summary, each with its ``<direction>_vs_dense`` ratio: the
#: payload's, and (runs under the network emulator) the link's (``wire_*``,
#: :mod:`simulations.netem.wire_columns`).
DIRECTIONS = ("uplink", "downlink", "total", "wire_uplink", "wire_downlink", "wire_total")
#: The summary keys that ``over_seeds`` averages (those a run has; NaN and null are skipped).
AGGREGATED = ("final_accuracy", "last10_accuracy", "best_accuracy", "final_loss",
              "uplink_bytes", "downlink_bytes", "total_bytes",
              "uplink_vs_dense", "downlink_vs_dense", "total_vs_dense",
              "uplink_compression", "downlink_compression", "total_compression",
              "wire_uplink_bytes", "wire_downlink_bytes", "wire_total_bytes",
              "wire_uplink_vs_dense", "wire_downlink_vs_dense", "wire_total_vs_dense",
              "wire_uplink_compression", "wire_downlink_compression", "wire_total_compression",
              "joules_per_client_round", "joules_total", "joules_to_target",
              "virtual_seconds", "virtual_seconds_to_target", "wall_seconds",
              "target_accuracy", "round_to_target", "wire_bytes_to_target",
              "equal_traffic_bytes", "last10_at_equal_traffic", "traffic_auc",
              "traffic_auc_mean", "reach_dense_round", "reach_dense_bytes", "curve_above_share")


#: What :func:`at_target` adds to an emulated run's summary (None: the run never reached it).
TO_TARGET = ("virtual_seconds_to_target", "round_to_target", "wire_bytes_to_target",
             "joules_to_target")


def at_target(runs: Mapping[str, Path], target: float = 0.0) -> dict[str, Any]:
    """Each emulated run's virtual seconds, round, wire bytes and joules to the target.

    ``runs`` maps a method to its run folder; a run without ``virtual_seconds`` in its
    ``rounds.csv`` (not emulated) is left out. ``target`` is ``netem.target_accuracy``: when 0,
    the dense run's last-10 accuracy (the first emulated run's without one,
    :func:`simulations.netem.target.derived_target`). Returns ``{"target": accuracy, "from":
    where it came from, "runs": {method: {key of TO_TARGET: value or None}}}``; empty runs when
    none is emulated.
    """
    rows_of = {m: read_rounds(d) for m, d in runs.items()}
    rows_of = {m: rows for m, rows in rows_of.items()
               if rows and all("virtual_seconds" in r for r in rows)}
    if not rows_of:
        return {"target": None, "from": "", "runs": {}}
    if target > 0:
        how = "netem.target_accuracy"
    else:
        target, derived = derived_target(rows_of, BASELINE)
        how = f"derived (netem.target_accuracy = 0): {derived}"
    out: dict[str, dict[str, Any]] = {}
    for m, rows in rows_of.items():
        reached = reach_target(rows, target)
        out[m] = dict(zip(TO_TARGET, (reached.virtual_s, reached.row, reached.wire_bytes,
                                      reached.joules) if reached else (None,) * 4, strict=True))
    return {"target": target, "from": how, "runs": out}


def family_of(method: str) -> tuple[str, bool]:
    """``(family, baseline)`` of the method a run names: its ``Method.family`` (or its name
    without one) and whether it is a baseline; a method this process does not know (removed,
    or a ``module:callable`` that no longer imports) is a family of its own."""
    try:
        m = registry.get(method)
    except SettingsError:
        return method, False
    return m.family or m.name, m.baseline


def by_family(methods: Sequence[str]) -> list[str]:
    """``methods`` family by family: the families in the order of their first method, each
    family's methods in their order (the default comparison's order does not change)."""
    families: dict[str, list[str]] = {}
    for m in methods:
        families.setdefault(family_of(m)[0], []).append(m)
    return [m for members in families.values() for m in members]


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; anything but distinct integers >= 0 names itself."""
    seeds: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise SettingsError(f"--seeds expects comma-separated integers >= 0 (e.g. 0,1,2), "
                                f"got {text!r}")
        seeds.append(int(item))
    if len(set(seeds)) != len(seeds):
        raise SettingsError(f"--seeds lists a seed twice: {text!r}")
    return seeds


def _ratio(dense: Any, sent: Any) -> float:
    return dense / sent if isinstance(dense, (int, float)) and sent else float("nan")


def against_dense(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Copies of ``summaries`` (method -> summary) with ``<direction>_vs_dense`` ratios.

    The ratios are the dense run's bytes over each method's, taken from the ``dense`` run of
    the same comparison (same seed, same sampled clients); without one, the summaries come back
    unchanged and each run's own ``*_compression`` is its ratio to dense FedAvg.
    """
    out = {name: dict(s) for name, s in summaries.items()}
    dense = summaries.get(BASELINE)
    if dense is None:
        return out
    for s in out.values():
        for d in DIRECTIONS:
            if f"{d}_bytes" in s or f"{d}_bytes" in dense:
                s[f"{d}_vs_dense"] = _ratio(dense.get(f"{d}_bytes"), s.get(f"{d}_bytes"))
    return out


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def over_seeds(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The aggregate ``compare.json`` of ``compare --seeds``: per method, mean and std.

    ``per_seed`` maps seed -> method -> summary (with its ``*_vs_dense`` ratios). For every key
    of :data:`AGGREGATED` a method has, ``mean`` and ``std`` are taken over the seeds whose value
    is finite; ``std`` is the sample standard deviation (n - 1), NaN (written null) for a single
    seed; ``reached`` counts, per key of :data:`TO_TARGET`, the seeds whose run reached the
    target (the mean is over those). ``per_seed`` keeps each run's values of those keys.
    """
    methods: list[str] = []
    for summaries in per_seed.values():
        methods += [m for m in summaries if m not in methods]
    doc: dict[str, Any] = {"seeds": list(per_seed), "baseline": BASELINE, "methods": {},
                           "per_seed": {}}
    for seed, summaries in per_seed.items():
        doc["per_seed"][str(seed)] = {m: {k: s[k] for k in AGGREGATED if k in s}
                                      for m, s in summaries.items()}
    for m in methods:
        runs = [s[m] for s in per_seed.values() if m in s]
        mean: dict[str, float] = {}
        std: dict[str, float] = {}
        for key in AGGREGATED:
            if not any(key in r for r in runs):
                continue
            values = _finite([r.get(key) for r in runs])
            mean[key] = statistics.fmean(values) if values else float("nan")
            std[key] = statistics.stdev(values) if len(values) > 1 else float("nan")
        # How many seeds reached the target: a mean over those that did says so.
        reached = {key: len(_finite([r.get(key) for r in runs])) for key in TO_TARGET
                   if any(key in r for r in runs)}
        doc["methods"][m] = {"runs": len(runs), "mean": mean, "std": std, "reached": reached}
    return doc


def traffic_curve(run_dir: Path) -> list[tuple[int, float]]:
    """``(cumulative uplink + downlink bytes, accuracy)`` after each round of a run folder.

    A ``rounds.csv`` that is not a regular file (a folder, a FIFO), has no header, or holds a
    negative byte count is a SettingsError naming it; one with a header and no row is a run
    without a round (an empty curve).
    """
    path = Path(run_dir) / "rounds.csv"
    check_regular(path)
    curve, total = [], 0
    try:
        with path.open() as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                raise SettingsError(f"{path} is empty: not a fedgc rounds.csv")
            for row in reader:
                sent = [int(row["uplink_bytes"]), int(row["downlink_bytes"])]
                if min(sent) < 0:
                    raise SettingsError(f"{path}: row {len(curve) + 1} has a negative byte "
                                        f"count {min(sent)}")
                total += sum(sent)
                curve.append((total, float(row["accuracy"])))
    except SettingsError:
        raise
    except OSError as ex:
        raise SettingsError(f"{path}: cannot be read ({ex.strerror or ex})") from None
    except (KeyError, TypeError, ValueError) as ex:  # a missing column, a short row, a bad number
        raise SettingsError(f"{path}: not a fedgc rounds.csv (row {len(curve) + 1}: "
                            f"{type(ex).__name__} {ex})") from None
    return curve


def check_regular(path: Path) -> None:
    """SettingsError when ``path`` exists but is not a regular file (a folder, a FIFO, a
    device): reading a FIFO would wait for ever, and a folder named like a result file is not
    one to skip silently."""
    if (path.exists() or path.is_symlink()) and not path.is_file():
        raise SettingsError(f"{path} is not a regular file; expected a fedgc {path.name}")


def at_equal_traffic(curves: Mapping[str, Sequence[tuple[int, float]]],
                     budget_method: str | None = None) -> dict[str, Any]:
    """Each method's accuracy at the total traffic of one method: by default the one that sent
    the least.

    The budget is the final cumulative total of ``budget_method``'s curve, or the smallest
    among ``curves`` (method -> output of :func:`traffic_curve`). A method's value is the mean
    accuracy of its last 10 rounds whose cumulative total is within the budget (as
    ``last10_accuracy`` is of the whole run); NaN when not even its first round fits. Returns
    ``{"method": the budget's method, "bytes": budget, "last10": {method: accuracy},
    "rounds": {method: rounds within the budget}}``.
    """
    finished = {m: c for m, c in curves.items() if c}
    if not finished:
        raise SettingsError(f"no run of {sorted(curves)} has a round: nothing to compare")
    if budget_method is None:
        budget_method = min(finished, key=lambda m: finished[m][-1][0])
    elif budget_method not in finished:
        raise SettingsError(f"budget method {budget_method!r} is not among the compared runs "
                            f"with a round: {sorted(finished)}")
    budget = finished[budget_method][-1][0]
    last10: dict[str, float] = {}
    rounds: dict[str, int] = {}
    for m, curve in finished.items():
        rounds[m] = sum(total <= budget for total, _ in curve)
        last10[m] = _last10_within(curve, budget)
    for m in curves.keys() - finished.keys():  # a run without a round reads as nothing
        last10[m], rounds[m] = float("nan"), 0
    return {"method": budget_method, "bytes": budget, "last10": last10, "rounds": rounds}


def _last10_within(curve: Sequence[tuple[int, float]], budget: float) -> float:
    """The mean accuracy of the last 10 rounds of ``curve`` whose cumulative total is within
    ``budget`` (NaN when not even the first round is)."""
    within = [acc for total, acc in curve if total <= budget]
    return statistics.fmean(within[-LAST_ROUNDS:]) if within else float("nan")


def accuracy_at_budget(curve: Sequence[tuple[int, float]], budget: float) -> float:
    """Where a run (a non-empty :func:`traffic_curve`) stands for a user with ``budget`` bytes:
    the mean accuracy of its last 10 rounds within the budget, 0 before its first round ends,
    and its final last-10 beyond its own final bytes (that user runs it to its end)."""
    if budget < curve[0][0]:
        return 0.0
    return _last10_within(curve, min(budget, curve[-1][0]))


def compressed_methods(methods: Sequence[str]) -> list[str]:
    """The methods of ``methods`` outside the dense family (dense FedAvg, FedAvgM): those
    whose curves :func:`curve_above` compares."""
    return [m for m in methods if family_of(m)[0] != family_of(BASELINE)[0]]


def curve_above(curves: Mapping[str, Sequence[tuple[int, float]]],
                points: int = 200) -> dict[str, Any]:
    """How much of the byte range each compressed method's curve is above every other's.

    Read as a user with a byte budget reads the band plots: at a budget, a method stands at
    the mean accuracy of its last 10 rounds within the budget (0 before its first round ends,
    its final last-10 beyond its own final bytes: that user runs it to its end). The budgets
    are ``points`` values log-spaced from the smallest first-round total of the compressed
    methods (:func:`compressed_methods`) to the largest final total. Returns ``{"floor",
    "ceiling": bytes, "share": {method: the fraction of budgets at which it stands at or above
    every other compressed method}, "beaten_by": {method: {other: the fraction at which other
    stands above it}}}``; with one compressed method its share is 1.0. ``share`` 1.0 is issue
    30's target "above every other compressed method's curve over the whole range".
    """
    if points < 2:
        raise ValueError(f"curve_above needs at least 2 budgets, got {points}")
    finished = {m: c for m, c in curves.items() if c and m in compressed_methods(list(curves))}
    if not finished:
        return {"floor": float("nan"), "ceiling": float("nan"), "share": {}, "beaten_by": {}}
    floor = min(c[0][0] for c in finished.values())
    ceiling = max(c[-1][0] for c in finished.values())
    if floor <= 0 or ceiling <= floor:
        budgets = [float(ceiling)]
    else:
        step = (math.log10(ceiling) - math.log10(floor)) / (points - 1)
        budgets = [10 ** (math.log10(floor) + i * step) for i in range(points)]
        budgets[-1] = float(ceiling)  # the last budget is exactly the largest final total

    at = {m: [accuracy_at_budget(c, b) for b in budgets] for m, c in finished.items()}
    share: dict[str, float] = {}
    beaten_by: dict[str, dict[str, float]] = {}
    for m, mine in at.items():
        others = {o: acc for o, acc in at.items() if o != m}
        share[m] = statistics.fmean(
            all(mine[i] >= acc[i] for acc in others.values()) for i in range(len(budgets)))
        beaten_by[m] = {o: statistics.fmean(acc[i] > mine[i] for i in range(len(budgets)))
                        for o, acc in others.items()}
    return {"floor": floor, "ceiling": ceiling, "share": share, "beaten_by": beaten_by}


def traffic_area(curves: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """The area under each method's accuracy against log10 of its cumulative total bytes.

    Read as a user with a byte budget reads the band plots: the accuracy reached after round
    ``i`` holds from that round's cumulative total to the next round's, and before a method's
    first round ends its accuracy counts as 0. Every area starts at the same floor, the
    smallest first-round total among ``curves``, and ends at the method's own final total.
    Returns ``{"floor": bytes, "area": {method: accuracy x decades}, "mean": {method: area /
    decades from the floor to its final total}}``; ``mean`` is the method's accuracy averaged
    over its byte range on the log axis (NaN for a method whose range is empty).
    """
    finished = {m: c for m, c in curves.items() if c}
    if not finished:
        raise ValueError("traffic_area needs at least one run with a round")
    floor = min(c[0][0] for c in finished.values())
    area: dict[str, float] = {}
    mean: dict[str, float] = {}
    for m, curve in finished.items():
        total = 0.0
        for (b0, acc), (b1, _) in zip(curve, curve[1:], strict=False):
            if b1 > b0 > 0:
                total += acc * (math.log10(b1) - math.log10(b0))
        area[m] = total
        decades = math.log10(curve[-1][0]) - math.log10(floor) if floor > 0 else 0.0
        mean[m] = total / decades if decades > 0 else float("nan")
    return {"floor": floor, "area": area, "mean": mean}


def reach(curve: Sequence[tuple[int, float]], target: float) -> tuple[float, float]:
    """``(round, cumulative total bytes)`` after which the mean accuracy of the last 10 rounds
    (of all rounds so far, before round 10) first reaches ``target``; NaNs when it never does.

    With ``target`` the dense run's ``last10_accuracy``, this reads when a method first stands
    where dense FedAvg ends, in rounds and in bytes.
    """
    for i in range(len(curve)):
        window = [acc for _, acc in curve[max(0, i - LAST_ROUNDS + 1):i + 1]]
        if statistics.fmean(window) >= target:
            return float(i + 1), float(curve[i][0])
    return float("nan"), float("nan")


def find_runs(folders: Sequence[Path]) -> dict[int | None, dict[str, Path]]:
    """The run folders of finished comparisons: seed (None without ``--seeds``) -> method -> folder.

    A folder is a ``compare`` folder (``<method>/rounds.csv``), a ``compare --seeds`` one
    (``seed-<s>/<method>/rounds.csv``), or one run (``rounds.csv`` and ``summary.json``, its
    method and seed read from the summary; a comparison's runs without a ``seed-<s>`` folder
    take their seed from their summaries too, when they have one). Several folders are merged,
    so that seeds or methods run apart are read together; a seed's method found twice, or a
    folder with no run, is an error.
    """
    found: dict[int | None, dict[str, Path]] = {}

    def add(seed: int | None, method: str, run: Path) -> None:
        if method in found.setdefault(seed, {}):
            raise SettingsError(f"{method} seed {seed} is in two folders: "
                                f"{found[seed][method]} and {run}")
        found[seed][method] = run

    for folder in map(Path, folders):
        if not folder.is_dir():
            raise SettingsError(f"no such comparison folder: {folder}")
        check_regular(folder / "rounds.csv")
        if (folder / "rounds.csv").is_file():
            summary = read_summary(folder)
            add(_seed_of(summary), summary.get("method", folder.name), folder)
            continue
        # ASCII digits: str.isdigit() also accepts 'seed-²', which int() refuses.
        seeded = sorted(d for d in folder.glob("seed-*")
                        if d.name[5:].isascii() and d.name[5:].isdigit())
        runs = [(int(d.name[5:]), run) for d in seeded for run in _runs_in(d)]
        # One seed's comparison: each run's seed is in its summary.
        runs += [(_seed_of(read_summary(run)) if (run / "summary.json").is_file() else None, run)
                 for run in ([] if seeded else _runs_in(folder))]
        if not runs:
            raise SettingsError(f"{folder} holds no run (no <method>/rounds.csv, "
                                f"seed-<s>/<method>/rounds.csv or rounds.csv)")
        for seed, run in runs:
            add(seed, run.name, run)
    return found


def _runs_in(folder: Path) -> list[Path]:
    runs = []
    for d in sorted(folder.iterdir()):
        check_regular(d / "rounds.csv")  # a method whose rounds.csv is a folder is not skipped
        if (d / "rounds.csv").is_file():
            runs.append(d)
    return runs


def _seed_of(summary: Mapping[str, Any]) -> int | None:
    config = summary.get("config")
    seed = config.get("seed") if isinstance(config, Mapping) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def read_summary(run: Path) -> dict[str, Any]:
    """A run folder's ``summary.json``; SettingsError naming the folder when it is missing,
    unreadable or not a JSON object."""
    check_regular(run / "summary.json")
    try:
        summary = json.loads((run / "summary.json").read_text())
    except RecursionError:
        raise SettingsError(f"{run}: summary.json nests too deeply to be a fedgc summary") \
            from None
    except (OSError, ValueError) as ex:
        raise SettingsError(f"{run}: no readable summary.json ({ex})") from None
    if not isinstance(summary, dict):
        raise SettingsError(f"{run}: summary.json is not a JSON object")
    for key in (*AGGREGATED, "dense_uplink_bytes", "dense_downlink_bytes", "dense_total_bytes"):
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SettingsError(f"{run}/summary.json: {key} = {value!r} is not a number")
    return summary
