"""The command line: ``run``, ``compare``, ``traffic``, ``demo``, ``keys``, ``methods``, ``flwr``
(the run through Flower's ``flwr run .``) and (other packages') ``deploy`` and ``wire``."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedgc import methods as registry
from fedgc.settings import (
    RunConfig,
    ServerSettings,
    SettingsError,
    TrainSettings,
    key_table,
    method_key_classes,
    new_run_name,
)
from server.app import (
    NothingAggregatedError,
    RunFolderError,
    flwr_app_config_toml,
    prepare_run_dir,
)
from server.checkpoint import CheckpointError, checkpoint_round
from server.folders import check_compare_folder, claim_compare_folder
from server.preflight import PreflightError, check_run
from server.registry import NoClientsError
from server.results import write_json
from simulations.cli_common import (
    columns_help,
    load_config_file,
    parse_sets,
    seeds_table,
    summary_table,
)
from simulations.cluster import ClusterError
from simulations.compare import (
    BASELINE,
    against_dense,
    at_equal_traffic,
    at_target,
    by_family,
    curve_above,
    find_runs,
    over_seeds,
    parse_seeds,
    reach,
    read_summary,
    traffic_area,
    traffic_curve,
)
from simulations.flwr_run import cmd_flwr
from simulations.interrupt import RunInterrupted
from simulations.netem.errors import NetemError
from simulations.netem.integration import split_netem
from simulations.netem.settings import NetemSettings, profile_line
from simulations.netem.target import target_of
from simulations.runner import check_engine, run_scenario
from simulations.scenario import load_scenario, scenario_names

#: The default comparison (``make demo``): the ``mnist5k`` scenario (100 clients, 10 per round,
#: Dirichlet(0.5) label skew, density 0.001 after a 4-round warm-up, on the MNIST 5k subset, 200
#: rounds) in ``results/demo/``, replacing an earlier demo. Client and server settings are the
#: defaults and only ``method`` differs between the runs (``cmd_compare``), so the comparison is
#: at equal client work.
DEMO: dict[str, object] = {**load_scenario("mnist5k"), "run_name": "demo", "overwrite": True}


def _values(args: argparse.Namespace, base: Mapping[str, object] | None) -> dict[str, object]:
    values: dict[str, object] = dict(base or {})
    if getattr(args, "scenario", None):
        values.update(load_scenario(args.scenario))
    if args.config:
        values.update(load_config_file(args.config))
    values.update(parse_sets(args.set or []))
    if getattr(args, "command", None) == "compare":
        name_comparison(values)
    return values


def name_comparison(values: dict[str, object]) -> None:
    """Give a comparison's keys without ``run_name`` one folder for the whole comparison, named
    for it (``<time>-<task>-compare``; a run's default names its method); a resume without
    ``run_name`` is left to RunConfig, which names the missing key."""
    resume = str(values.get("resume", "")).strip().lower() in ("true", "1", "yes", "on")
    if not values.get("run_name") and not resume:
        task = values.get("task", TrainSettings.task)
        values["run_name"] = new_run_name(str(values.get("results_dir",
                                                         ServerSettings.results_dir)),
                                          f"{task}-compare")


def build_config(args: argparse.Namespace, base: Mapping[str, object] | None = None) -> RunConfig:
    """Defaults < ``base`` < ``--scenario`` < ``--config FILE`` < ``--set key=value``.

    ``netem.*`` keys are left to :func:`build_netem`.
    """
    values = _values(args, base)
    return RunConfig.from_flat({k: v for k, v in values.items() if not k.startswith("netem.")})


def build_netem(args: argparse.Namespace, base: Mapping[str, object] | None = None) -> Any:
    """The network emulator's settings from the ``netem.*`` keys (disabled when none)."""
    return split_netem(_values(args, base))[1]


def cmd_run(config: RunConfig, verbose: bool, netem: Any = None) -> dict[str, Any]:
    """Run one scenario, plot it, print its table."""
    # Imported here: start-up; matplotlib loads only when something is plotted.
    from simulations.plots import plot_run

    # Checked before it is announced: a misspelt key or task option, a run its engine or this
    # machine cannot run, a damaged checkpoint stop before the run's first line.
    check_engine(config, netem)
    prepare_run_dir(config).release()  # the run takes the folder's lock again
    print(f"fedgc: {announcement(config)}", flush=True)
    _print_emulator(netem)
    summary = run_scenario(config, verbose=verbose, netem=netem)
    plot = plot_run(config.run_dir)
    print(summary_table({config.method.title: summary}))
    bounded = summary.get("defences", {})
    if (bounded.get("weights_capped") or bounded.get("updates_clipped")
            or bounded.get("updates_left_out")):
        print(f"defences: {bounded['weights_capped']} weights capped, "
              f"{bounded['updates_clipped']} updates clipped, "
              f"{bounded.get('updates_left_out', 0)} left out (clients.csv's reason)")
    board = ", tensorboard/" if config.server.tensorboard else ""
    print(f"results: {config.run_dir}/rounds.csv, summary.json, {plot.name}{board}")
    return summary


def announcement(config: RunConfig) -> str:
    """A run's first line: what runs where, and for a resumed run the round it resumes after
    (its checkpoint's)."""
    t, rounds = config.train, config.server.rounds
    what = (f"{config.method.title} on {t.task}, {t.num_clients} clients "
            f"({t.clients_per_round} per round)")
    done = checkpoint_round(config.run_dir) if config.server.resume else None
    if done is None:
        return f"running {what}, {rounds} rounds -> {config.run_dir}"
    if done >= rounds:
        return (f"resuming {what}: its checkpoint is of round {done}, and rounds = {rounds} "
                f"leaves none to run -> {config.run_dir}")
    return (f"resuming {what} after round {done} (its checkpoint): rounds {done + 1}-{rounds} "
            f"-> {config.run_dir}")


def _print_emulator(netem: Any) -> None:
    """The run's header line of the network emulator: links, deadline and the protocol
    profile charged (docs/netem.md, "A round's time"); nothing when it is off."""
    if netem is None or not netem.enabled:
        return
    deadline = f"deadline {netem.deadline_s:g} s" if netem.deadline_s > 0 else "no deadline"
    target = (f"target accuracy {netem.target_accuracy:g}" if netem.target_accuracy > 0
              else "target accuracy derived (dense's last-10 in a comparison)")
    print(f"fedgc: network emulator: links {netem.mix}, {netem.intermittent:.0%} intermittent, "
          f"{deadline}, {target}; protocol profile {profile_line(netem)}", flush=True)


def _method_config(config: RunConfig, method: str) -> RunConfig:
    """``config`` for one method of a comparison, in ``<run_dir>/<folder of the method>/``."""
    return config.with_overrides({"method": method, "results_dir": str(config.run_dir),
                                  "run_name": method_folder(method), "state_dir": ""})


def method_folder(method: str) -> str:
    """The folder of one method's run in a comparison: its name, or for ``module:callable``
    its label (a folder name of letters, digits, ``.``, ``_`` and ``-``)."""
    if method in registry.names():
        return method
    return re.sub(r"[^A-Za-z0-9._-]+", "_", registry.get(method).title)


#: What ``--methods`` takes for every registered method (in ``compare``'s order).
ALL_METHODS = "all"


def check_methods(methods: Sequence[str], what: str) -> list[str]:
    """``methods`` (registered names or ``module:callable``; ``all``: every registered method)
    after loading each; SettingsError naming ``what`` when there are none, one is unknown, or
    two share a folder."""
    if ALL_METHODS in methods:
        at = list(methods).index(ALL_METHODS)
        methods = [*methods[:at], *registry.names(), *methods[at + 1:]]
    bad = [m for m in methods if not registry.is_known(m)]
    if bad or not methods:
        raise SettingsError(f"{what} must be a non-empty subset of {list(registry.names())} "
                            f"or 'module:callable' references ('{ALL_METHODS}': every "
                            f"registered one), got {list(methods)!r}")
    for m in methods:
        registry.get(m)  # a SettingsError naming a reference that does not load
    folders = [method_folder(m) for m in methods]
    if len(set(folders)) != len(folders):
        raise SettingsError(f"{what} lists a method twice, or two whose labels share a "
                            f"folder: {list(methods)!r}")
    return list(methods)


def _run_in_worker(config: RunConfig, verbose: bool, netem: Any) -> dict[str, Any]:
    """One run of ``compare --jobs N`` in a worker process, on one torch thread."""
    import torch

    torch.set_num_threads(1)  # N runs side by side must not each spread over every core
    return run_scenario(config, verbose=verbose, netem=netem)


def _run_all(configs: Sequence[RunConfig], verbose: bool, netem: Any,
             jobs: int) -> list[dict[str, Any]]:
    """The summaries of ``configs``' runs, in order; ``jobs`` runs at a time."""
    def started(c: RunConfig, verb: str = "") -> None:
        print(f"fedgc: {verb}[{c.method.title}] seed {c.train.seed}, {c.server.rounds} rounds "
              f"-> {c.run_dir}", flush=True)

    if jobs == 1:
        out = []
        for c in configs:
            started(c)
            out.append(run_scenario(c, verbose=verbose, netem=netem))
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {}
        for i, c in enumerate(configs):
            started(c, "queued ")
            futures[pool.submit(_run_in_worker, c, verbose, netem)] = i
        out_by_index: dict[int, dict[str, Any]] = {}
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            out_by_index[i] = future.result()
            c = configs[i]
            print(f"fedgc: [{c.method.title}] seed {c.train.seed} done ({done}/{len(configs)}): "
                  f"final accuracy {out_by_index[i].get('final_accuracy', float('nan')):.4f}",
                  flush=True)
    return [out_by_index[i] for i in range(len(configs))]


def _finish_once(config: RunConfig, summaries: dict[str, dict[str, Any]],
                 runs: dict[str, Path], budget_method: str | None,
                 target: float = 0.0) -> dict[str, dict[str, Any]]:
    """Ratios to dense, the readings at the target accuracy (emulated runs; ``target``:
    ``netem.target_accuracy``), ``<run_dir>/compare.json``, ``compare.png`` and the printed
    table."""
    # Imported here: start-up; matplotlib loads only when something is plotted.
    from simulations.plots import plot_runs

    base = config.run_dir
    summaries = against_dense(summaries)
    equal = _read_at_budget(summaries, runs, budget_method)
    reading = at_target(runs, target)
    for m, values in reading["runs"].items():
        summaries[m].update(values, target_accuracy=reading["target"],
                            target_from=reading["from"])
    base.mkdir(parents=True, exist_ok=True)
    write_json(base / "compare.json", {"methods": summaries})
    plot = plot_runs(runs, base / "compare.png", target=reading["target"])
    label = {m: s.get("label", m) for m, s in summaries.items()}  # as the table names them
    print(summary_table({label[m]: s for m, s in summaries.items()}))
    print(_equal_traffic_line(f"{label.get(equal['method'], equal['method'])}'s", equal["bytes"],
                              {label[m]: a for m, a in equal["last10"].items()}))
    if reading["runs"]:
        print(_target_line(reading["target"], reading["from"], next(
            (s.get("wire", {}).get("profile") for s in summaries.values() if "wire" in s), None)))
    print(f"results: {base}/compare.json, {plot.name}")
    return summaries


def _target_line(target: float, how: str, profile: str | None) -> str:
    """The line under an emulated comparison's table: the target and the profile charged."""
    line = f"target accuracy {target:.4f} ({how})"
    return line + (f"; virtual times under the protocol profile {profile}" if profile else "")


def _read_at_budget(summaries: Mapping[str, dict[str, Any]], runs: Mapping[str, Path],
                    budget_method: str | None) -> dict[str, Any]:
    """Add every method's reading at ``budget_method``'s total traffic to its summary
    (``equal_traffic_method``, ``equal_traffic_bytes``, ``last10_at_equal_traffic``), the
    area under its curve (``traffic_auc*``), for a compressed method how much of the byte range
    its curve is above the others' (``curve_above_share``, ``curve_beaten_by``) and when it
    reaches dense's last-10 (``reach_dense_*``); return
    :func:`simulations.compare.at_equal_traffic`'s result."""
    curves = {m: traffic_curve(run) for m, run in runs.items()}
    equal = at_equal_traffic(curves, budget_method)
    area = traffic_area(curves)
    for m, s in summaries.items():
        s["equal_traffic_method"] = equal["method"]
        s["equal_traffic_bytes"] = equal["bytes"]
        s["last10_at_equal_traffic"] = equal["last10"][m]
        s["traffic_auc_floor_bytes"] = area["floor"]
        s["traffic_auc"] = area["area"].get(m, float("nan"))
        s["traffic_auc_mean"] = area["mean"].get(m, float("nan"))
    above = curve_above(curves)
    for m, share in above["share"].items():
        s = summaries[m]
        s["curve_above_share"] = share
        s["curve_beaten_by"] = above["beaten_by"][m]
    dense = summaries.get(BASELINE, {}).get("last10_accuracy")
    if isinstance(dense, (int, float)):
        for m, s in summaries.items():
            s["reach_dense_round"], s["reach_dense_bytes"] = reach(curves[m], float(dense))
    return equal


def _print_mean_at_budget(doc: Mapping[str, Any], budget_method: str | None) -> None:
    """The line under ``compare --seeds``' table: every method at the budget, mean over seeds."""
    means = {m: d["mean"] for m, d in doc["methods"].items()}
    budget = next(iter(means.values()))["equal_traffic_bytes"]  # the same for every method
    whose = f"{budget_method}'s" if budget_method else "the cheapest method's"
    print(_equal_traffic_line(f"{whose} mean", budget,
                              {m: v["last10_at_equal_traffic"] for m, v in means.items()}))


def _equal_traffic_line(whose: str, budget: float, last10: Mapping[str, float]) -> str:
    # Many methods make a long line: wrapped at 100 columns between "method accuracy" pairs.
    lines = [f"last-10 accuracy at {whose} total traffic ({budget / 1e6:.2f} MB):"]
    for i, (m, a) in enumerate(last10.items()):
        value = f"{a:.4f}" if isinstance(a, (int, float)) and math.isfinite(a) else "n/a"
        item = f"{m} {value}" + ("," if i < len(last10) - 1 else "")
        if len(lines[-1]) + 1 + len(item) > 100:
            lines.append(" ")
        lines[-1] += " " + item
    return "\n".join(lines)


def cmd_compare(config: RunConfig, verbose: bool, methods: Sequence[str] | None = None,
                netem: Any = None, seeds: Sequence[int] | None = None,
                jobs: int = 1, budget_method: str | None = None) -> dict[str, Any]:
    """The same scenario with each method; ``compare.json`` and a plot in one folder.

    Without ``seeds``: ``<run_dir>/<method>/`` per method, ``compare.json`` (the summaries, with
    their ratios to the ``dense`` run) and ``compare.png``. With ``seeds``: the same once per
    seed (the ``seed`` key) in ``<run_dir>/seed-<s>/``, then ``<run_dir>/compare.json`` with
    each method's mean and std over the seeds (:func:`simulations.compare.over_seeds`) and
    ``<run_dir>/accuracy_vs_traffic.png``, one band per method.

    ``jobs > 1`` runs that many runs at a time, each in its own process on one torch thread:
    the same results (a run depends on its seed only), for ``sim.engine=local`` only, since a
    Ray run takes every CPU it is given.

    Every method is also read at the total traffic of ``budget_method`` (default: the method
    that sent the least): ``last10_at_equal_traffic``
    (:func:`simulations.compare.at_equal_traffic`).
    """
    # Imported here: start-up; matplotlib loads only when something is plotted.
    from simulations.plots import plot_bands

    methods = by_family(registry.compared() if methods is None
                        else check_methods(methods, "methods"))
    if not isinstance(jobs, int) or jobs < 1:
        raise SettingsError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if budget_method is not None and budget_method not in methods:
        raise SettingsError(f"--budget-method {budget_method!r} is not among the compared "
                            f"methods {list(methods)}")
    if jobs > 1 and config.server.engine == "ray":
        raise SettingsError(f"--jobs {jobs} needs sim.engine=local or batched (got "
                            f"{config.server.engine!r}): Ray runs each take every CPU")
    per_config = ([config] if seeds is None else
                  [config.with_overrides({"seed": s, "results_dir": str(config.run_dir),
                                          "run_name": f"seed-{s}"}) for s in seeds])
    if jobs > 1:  # interleaved per-round lines from several runs read as noise
        per_config = [c.with_overrides({"progress": False}) for c in per_config]
    plan = [_method_config(c, m) for c in per_config for m in methods]
    # The folder is the comparison's alone (not a run's), and nothing is created in it before
    # the first run's checks pass.
    compare_id = check_compare_folder(config.run_dir)
    check_run(plan[0])
    claim_compare_folder(config.run_dir, compare_id)
    _print_emulator(netem)
    done = iter(zip(plan, _run_all(plan, verbose, netem, jobs), strict=True))
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    folders: dict[str, list[Path]] = {m: [] for m in methods}
    for c in per_config:
        runs_of_seed = [next(done) for _ in methods]
        summaries = {r.train.method: summary for r, summary in runs_of_seed}
        runs = {r.train.method: r.run_dir for r, _ in runs_of_seed}
        per_seed[c.train.seed] = _finish_once(
            c, summaries, runs, budget_method,
            netem.target_accuracy if netem is not None and netem.enabled else 0.0)
        for m, run_dir in runs.items():
            folders[m].append(run_dir)
    if seeds is None:
        return {"methods": per_seed[config.train.seed]}
    base = config.run_dir
    doc = over_seeds(per_seed)
    write_json(base / "compare.json", doc)
    plot = plot_bands(folders, base / "accuracy_vs_traffic.png")
    print(f"mean +- std over seeds {', '.join(map(str, per_seed))}:")
    print(seeds_table(doc))
    _print_mean_at_budget(doc, budget_method)
    print(f"results: {base}/compare.json, {plot.name}")
    return doc


def cmd_traffic(folders: Sequence[Path], budget_method: str | None = None,
                out: Path | None = None) -> dict[str, Any]:
    """Read finished comparisons again, merged, at one method's total traffic; nothing runs.

    ``folders`` are ``compare`` folders (with or without ``--seeds``) or single runs; several
    are merged by seed (:func:`simulations.compare.find_runs`: seeds or methods run apart).
    Per seed, the summaries get their ratios to that seed's dense run and every method's
    last-10 accuracy within ``budget_method``'s total traffic (default: the method that sent
    the least; :func:`simulations.compare.at_equal_traffic`); then mean and std over seeds as
    in ``compare --seeds`` (:func:`simulations.compare.over_seeds`), printed as its table. With
    ``out``, ``compare.json`` and ``accuracy_vs_traffic.png`` are written there. Returns the
    aggregate document.
    """
    # Imported here: start-up; matplotlib loads only when something is plotted.
    from simulations.plots import plot_bands

    if out is not None and (out.exists() or out.is_symlink()) and not out.is_dir():
        raise SettingsError(f"--out {out} is not a folder; name a folder for compare.json and "
                            f"accuracy_vs_traffic.png")
    runs = find_runs(folders)
    if budget_method is not None:
        missing = [s for s, by_method in runs.items() if budget_method not in by_method]
        if missing:
            raise SettingsError(f"--budget-method {budget_method}: no {budget_method} run for "
                                f"seed(s) {missing}")
    per_seed: dict[Any, dict[str, dict[str, Any]]] = {}
    for seed, by_method in sorted(runs.items(), key=lambda kv: (kv[0] is None, kv[0])):
        by_method = {m: by_method[m] for m in by_family(sorted(by_method, key=_method_order))}
        summaries = against_dense({m: read_summary(r) for m, r in by_method.items()})
        equal = _read_at_budget(summaries, by_method, budget_method)
        try:
            reading = at_target(by_method, target_of(summaries))
        except ValueError as ex:
            raise SettingsError(str(ex)) from None
        for m, values in reading["runs"].items():
            summaries[m].update(values, target_accuracy=reading["target"],
                                target_from=reading["from"])
        per_seed[seed] = summaries
        label = "" if seed is None else f"seed {seed}: "
        print(label + _equal_traffic_line(f"{equal['method']}'s", equal["bytes"], equal["last10"]))
    doc = over_seeds(per_seed)
    doc["equal_traffic_method"] = budget_method
    doc["folders"] = [str(f) for f in folders]
    print(f"mean +- std over seeds {', '.join(map(str, per_seed))}:")
    print(seeds_table(doc))
    _print_mean_at_budget(doc, budget_method)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as ex:
            raise SettingsError(f"--out {out} cannot be created: {ex.strerror or ex}") from None
        write_json(out / "compare.json", doc)
        methods = list(doc["methods"])
        plot = plot_bands({m: [by_m[m] for by_m in runs.values() if m in by_m] for m in methods},
                          out / "accuracy_vs_traffic.png")
        print(f"results: {out}/compare.json, {plot.name}")
    return doc


def _method_order(method: str) -> tuple[int, str]:
    names = registry.names()
    return (names.index(method) if method in names else len(names), method)


def cmd_keys(flwr_toml: bool = False, prefixes: Sequence[str] = ()) -> None:
    """Print every configuration key with the part that owns it, type, default and range (with
    ``prefixes``, the keys starting with one of them or owned by a part of that name); with
    ``flwr_toml`` the ``[tool.flwr.app.config]`` table of ``pyproject.toml`` instead.

    A prefix that no key starts with and no part is named is a SettingsError listing the
    parts."""
    if flwr_toml:
        print(flwr_app_config_toml(), end="")
        return

    own = method_key_classes(registry.registered())
    rows = key_table([ServerSettings, TrainSettings, NetemSettings, *own])
    for prefix in prefixes:
        if not any(row.key.startswith(prefix) or row.part == prefix for row in rows):
            parts = sorted({row.part for row in rows})
            raise SettingsError(f"no key starts with {prefix!r} and no part is named so; the "
                                f"parts are {', '.join(parts)}")
    for row in rows:
        if prefixes and not any(row.key.startswith(p) or row.part == p for p in prefixes):
            continue
        print("\n".join(key_lines(row.key, row.part, row.kind, row.default, row.accepted,
                                   row.doc)))


#: The width of ``keys``' lines (the project's line length).
KEYS_WIDTH = 100


def key_lines(key: str, part: str, kind: str, default: str, accepted: str, doc: str,
              width: int = KEYS_WIDTH) -> list[str]:
    """One key of ``keys``: its name, part, type, default and range on a line (the range
    under it when it does not fit), then its description, indented, wrapped to ``width``."""
    import textwrap

    head = f"{key:<30} {part:<6} {kind:<5} {default}"
    if len(f"{head:<58} {accepted}") <= width:
        head, text = f"{head:<58} {accepted}", doc
    else:
        text = f"accepted: {accepted}. {doc}"
    wrap = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="    ",
                                break_long_words=True, break_on_hyphens=False)
    return textwrap.wrap(head, width, subsequent_indent="    ") + wrap.wrap(text)


def methods_table() -> list[str]:
    """The methods table of ``docs/methods.md``, from the registry: every registered method's
    client, payload, residual, defaults, downlink and phone support (``python -m simulations
    methods``; ``tests/test_methods.py`` checks the docs hold it)."""
    lines = ["| method | a client sends | it keeps | payload | its defaults | clients are sent "
             "| phones | compare |",
             "|---|---|---|---|---|---|---|---|"]
    for m in registry.registered():
        config = RunConfig.from_flat({"method": m.name, "run_name": "table"})
        down = m.downlink(config)
        sent = ("the exact model" if down.density >= 1.0 else
                f"the {down.values} broadcast at `downlink_density` {down.density:g}")
        defaults = ", ".join(f"`{k}` {v!r}" for k, v in m.defaults.items()) or "-"
        label = f"`{m.name}`" + (f" ({m.label})" if m.label and m.label != m.name else "")
        lines.append(f"| {label} | {m.description} | "
                     f"{'its residual' if m.keeps_residual else 'nothing'} | "
                     f"`{m.codec(config.train).kind}` | {defaults} | {sent} | "
                     f"{'yes' if m.phone else 'no'} | {'yes' if m.compared else 'named'} |")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulations",
                                description="fedgc: federated learning with Deep Gradient "
                                            "Compression on Flower's simulation engine")
    sub = p.add_subparsers(dest="command", required=True)

    def scenario(name: str, help_text: str, named: bool = True,
                 epilog: str | None = None) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help_text, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if named:
            q.add_argument("--scenario", metavar="NAME",
                           help=f"a shipped scenario ({', '.join(scenario_names())}); "
                                f"--config and --set override its keys")
        q.add_argument("--config", metavar="FILE", help="TOML file of keys ([dgc] tables "
                       "flatten to dgc.*); see `python -m simulations keys`")
        q.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="override one key (repeatable)")
        q.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
        return q

    scenario("run", "run one scenario")
    scenario("flwr", "run one scenario with Flower's `flwr run .`: keys checked first, the "
                     "federation sized to num_clients, a local SuperLink started and stopped "
                     "if none runs, the run's status as exit status")
    compared = registry.compared()
    c = scenario("compare", f"run {', '.join(compared)} on the same scenario and plot them",
                 epilog=columns_help())
    c.add_argument("--methods", default=",".join(compared),
                   help=f"comma-separated methods among {','.join(registry.names())}, or your "
                        f"own as module:callable; '{ALL_METHODS}': every registered method "
                        f"(the catalogue)")
    c.add_argument("--seeds", metavar="S,S,...",
                   help="run the comparison once per seed (e.g. 0,1,2) into seed-<s>/, and "
                        "write the mean and std over seeds")
    c.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs at a time, each in its own process on one thread "
                        "(sim.engine=local only); default 1")
    c.add_argument("--budget-method", metavar="METHOD",
                   help="read every method at this method's total traffic "
                        "(last10_at_equal_traffic); default: the method that sent the least")
    t = sub.add_parser("traffic", help="read finished comparisons again at one method's "
                                       "total traffic")
    t.add_argument("folders", nargs="+", type=Path, metavar="FOLDER",
                   help="compare folders (with or without --seeds) or single runs; several "
                        "are merged")
    t.add_argument("--budget-method", metavar="METHOD",
                   help="whose total traffic is the budget; default: the method that sent "
                        "the least, per seed")
    t.add_argument("--out", type=Path, metavar="DIR",
                   help="write the merged compare.json and accuracy_vs_traffic.png there")
    scenario("demo", "the default comparison (what `make demo` runs)", named=False,
             epilog=columns_help())
    k = sub.add_parser("keys", help="list every configuration key (or those of PREFIX)")
    k.add_argument("prefixes", nargs="*", metavar="PREFIX",
                   help="list only the keys that start with PREFIX (netem, dgc.shared) or that "
                        "a part of that name owns (server, client, sim, attack, netem, a "
                        "method's prefix)")
    k.add_argument("--flwr-toml", action="store_true",
                   help="print the [tool.flwr.app.config] table of pyproject.toml (`flwr run .`)")
    sub.add_parser("methods", help="the registered compression methods, as docs/methods.md's "
                                   "table")
    sub.add_parser("deploy", help="deployment tools (simulations.deploy)", add_help=False)
    sub.add_parser("wire", help="where a captured run's bytes go (simulations.wire)",
                   add_help=False)
    return p


def _one_line(ex: BaseException) -> str:
    # Some causes (torch's unpickler) explain themselves over many lines: the first names it.
    lines = str(ex).strip().splitlines() or [type(ex).__name__]
    return lines[0] + (" [...]" if len(lines) > 1 else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m simulations``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "deploy":
        try:
            # Imported here: start-up; cryptography and the deployment load for deploy only.
            from simulations.deploy.cli import main as deploy_main
        except ModuleNotFoundError as ex:
            if ex.name not in ("simulations.deploy", "simulations.deploy.cli"):
                raise
            print("python -m simulations deploy: error: simulations.deploy is not installed",
                  file=sys.stderr)
            return 2
        return int(deploy_main(argv[1:]) or 0)
    if argv and argv[0] == "wire":
        # Imported here: start-up; cryptography and the capture analysis load for wire only.
        from simulations.wire.cli import main as wire_main

        return wire_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "keys":
            cmd_keys(args.flwr_toml, args.prefixes)
        elif args.command == "methods":
            print("\n".join(methods_table()))
        elif args.command == "run":
            cmd_run(build_config(args), args.verbose, build_netem(args))
        elif args.command == "compare":
            methods = check_methods([m.strip() for m in args.methods.split(",") if m.strip()],
                                    "--methods")
            seeds = parse_seeds(args.seeds) if args.seeds is not None else None
            cmd_compare(build_config(args), args.verbose, methods, build_netem(args), seeds,
                        args.jobs, args.budget_method)
        elif args.command == "traffic":
            cmd_traffic(args.folders, args.budget_method, args.out)
        elif args.command == "flwr":
            return cmd_flwr(_values(args, None), args.verbose)
        elif args.command == "demo":
            cmd_compare(build_config(args, DEMO), args.verbose, netem=build_netem(args, DEMO))
    except (SettingsError, RunFolderError, NetemError, PreflightError, CheckpointError,
            ClusterError, NoClientsError) as ex:
        print(f"python -m simulations {args.command}: error: {_one_line(ex)}", file=sys.stderr)
        return 2
    except NothingAggregatedError as ex:
        print(f"python -m simulations {args.command}: run failed: {_one_line(ex)}",
              file=sys.stderr)
        return 1
    except RunInterrupted as ex:
        print(f"python -m simulations {args.command}: {ex}{_resume_hint(args.command, ex)}",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"python -m simulations {args.command}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    return 0


#: The exit status of a run stopped by Ctrl-C: the shell's for a command ended by SIGINT.
INTERRUPTED = 130


def _resume_hint(command: str, ex: RunInterrupted) -> str:
    """How to continue an interrupted ``run`` (a comparison's runs are resumed one by one)."""
    if command != "run" or not ex.checkpoint or ex.last_round == 0:
        return ""
    where = ("" if ex.run_dir.parent == Path(ServerSettings.results_dir)
             else f" --set results_dir={ex.run_dir.parent}")
    return (f"; to continue it, run the same command with --set run_name={ex.run_dir.name}"
            f"{where} --set resume=true")
