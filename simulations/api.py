"""The Python API: ``run``, ``compare`` and ``results`` from a notebook, on the command line's
own code path (also as ``fedgc.run``, ``fedgc.compare``, ``fedgc.results``).

::

    import fedgc
    from simulations.api import run, compare   # the same functions

    result = run("mnist5k", rounds=20, sim__engine="local")
    result.summary["final_accuracy"], result.rounds[-1]["uplink_bytes"], result.folder
    result.plot()                                   # <folder>/plots.png

    both = compare(config={"task": "digits", "rounds": 10}, methods=["dense", "dgc"])
    both.summary["methods"]["dgc"]["uplink_vs_dense"], both.runs["dgc"][0].rounds
    again = fedgc.results(both.folder)              # read back later, from its folder

Keys merge as on the command line: defaults < ``scenario`` < ``config`` (a TOML file, or a dict
of keys) < ``**keys``. A keyword's ``__`` stands for the key's dot (``dgc__density=0.01`` is
``dgc.density``); dotted keys can also go in ``config``. Options keys take dicts
(``model_options={"hidden": [64]}``). Errors are the command line's: a
:class:`fedgc.settings.SettingsError` names a bad key, a ``PreflightError`` a run that cannot
work, before round 1. An interrupt (a notebook's stop button, Ctrl-C) stops the run within
seconds and raises :class:`simulations.interrupt.RunInterrupted`, a KeyboardInterrupt that
says which round the run folder kept.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgc.methods import compared
from fedgc.settings import RunConfig
from simulations.cli import check_methods, cmd_compare, cmd_run, method_folder, name_comparison
from simulations.cli_common import load_config_file
from simulations.netem.integration import split_netem
from simulations.scenario import load_scenario

__all__ = ["CompareResult", "RunResult", "compare", "config_of", "results", "run"]


@dataclass(frozen=True)
class RunResult:
    """One finished run, read back from its folder.

    Attributes
    ----------
    folder : Path
        The run folder (``<results_dir>/<run_name>``).
    summary : dict
        ``summary.json``.
    rounds : list of dict
        The rows of ``rounds.csv``, one per round, with numbers as int or float.
    """

    folder: Path
    summary: dict[str, Any] = field(repr=False)
    rounds: list[dict[str, int | float]] = field(repr=False)

    @classmethod
    def read(cls, folder: str | Path, summary: Mapping[str, Any] | None = None) -> RunResult:
        """The result of the run in ``folder`` (``summary``: its summary, when already read)."""
        folder = Path(folder)
        if summary is None:
            summary = json.loads((folder / "summary.json").read_text())
        return cls(folder, dict(summary), read_rounds_table(folder / "rounds.csv"))

    def plot(self, path: str | Path | None = None) -> Path:
        """Plot accuracy against traffic and bytes per round to ``path`` (default
        ``<folder>/plots.png``); returns the file."""
        # Imported here: start-up; matplotlib loads only when something is plotted.
        from simulations.plots import plot_run, plot_runs

        if path is None:
            return plot_run(self.folder)
        return plot_runs({self.folder.name: self.folder}, path, title=str(self.folder))


@dataclass(frozen=True)
class CompareResult:
    """A finished comparison: ``compare.json`` and the runs it compared.

    Attributes
    ----------
    folder : Path
        The comparison's folder.
    summary : dict
        ``compare.json``: ``{"methods": {method: summary}}``, with seeds each method's mean and
        std over them.
    runs : dict of str to list of RunResult
        Each method's runs, one per seed (one without seeds).
    """

    folder: Path
    summary: dict[str, Any] = field(repr=False)
    runs: dict[str, list[RunResult]] = field(repr=False)

    def plot(self, path: str | Path | None = None) -> Path:
        """The comparison's plot to ``path`` (default: the command line's, ``compare.png``, or
        ``accuracy_vs_traffic.png`` with seeds); returns the file."""
        # Imported here: start-up; matplotlib loads only when something is plotted.
        from simulations.plots import plot_bands, plot_runs

        if max(len(r) for r in self.runs.values()) > 1:
            return plot_bands({m: [r.folder for r in rs] for m, rs in self.runs.items()},
                              path or self.folder / "accuracy_vs_traffic.png")
        return plot_runs({m: rs[0].folder for m, rs in self.runs.items()},
                         path or self.folder / "compare.png")


def read_rounds_table(path: Path) -> list[dict[str, int | float]]:
    """The rows of a ``rounds.csv``: each value an int when it is one, else a float."""
    def number(text: str) -> int | float:
        try:
            return int(text)
        except ValueError:
            return float(text) if text not in ("", "nan") else float("nan")

    with path.open() as fh:
        return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def config_of(scenario: str | None = None, config: str | Path | Mapping[str, Any] | None = None,
              comparison: bool = False, **keys: Any) -> tuple[RunConfig, Any]:
    """The run's (or with ``comparison``, the comparison's) RunConfig and NetemSettings from
    the same layers as the command line."""
    values: dict[str, Any] = {}
    if scenario is not None:
        values.update(load_scenario(scenario))
    if isinstance(config, Mapping):
        values.update(config)
    elif config is not None:
        values.update(load_config_file(str(config)))
    for name, value in keys.items():
        values[name.replace("__", ".")] = value
    if comparison:
        name_comparison(values)
    rest, netem = split_netem(values)
    return RunConfig.from_flat(rest), netem


def run(scenario: str | None = None, config: str | Path | Mapping[str, Any] | None = None,
        *, verbose: bool = False, **keys: Any) -> RunResult:
    """Run one scenario as ``python -m simulations run`` does; returns its results.

    Parameters
    ----------
    scenario : str or None
        A shipped scenario (``python -m simulations run --scenario``).
    config : path, dict or None
        A TOML file of keys (``--config``), or a dict of keys.
    verbose : bool
        Show Flower's and Ray's logs (``--verbose``).
    **keys
        Keys over the others (``--set``); ``__`` for a dot: ``dgc__density=0.01``.
    """
    run_config, netem = config_of(scenario, config, **keys)
    summary = cmd_run(run_config, verbose, netem)
    return RunResult.read(run_config.run_dir, summary)


def compare(scenario: str | None = None, config: str | Path | Mapping[str, Any] | None = None,
            *, methods: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
            jobs: int = 1, verbose: bool = False, **keys: Any) -> CompareResult:
    """Run the same scenario with each of ``methods`` (default: those ``compare`` runs; your own
    as ``"module:callable"``) as ``python -m simulations compare`` does (``seeds``: once per
    seed; ``jobs``: runs at a time, ``sim__engine="local"`` only); returns ``compare.json`` and
    the runs."""
    methods = list(compared()) if methods is None else check_methods(list(methods), "methods")
    run_config, netem = config_of(scenario, config, comparison=True, **keys)
    doc = cmd_compare(run_config, verbose, methods, netem,
                      list(seeds) if seeds is not None else None, jobs)
    return _comparison(run_config.run_dir, doc, methods, seeds)


def results(folder: str | Path) -> RunResult | CompareResult:
    """A finished run or comparison, read back from its folder: a run's ``summary.json`` and
    ``rounds.csv``, or a comparison's ``compare.json`` and its runs (one per method, and per
    seed in ``seed-<s>/``)."""
    folder = Path(folder)
    if (folder / "compare.json").is_file():
        doc = json.loads((folder / "compare.json").read_text())
        seeds = sorted(int(p.name[5:]) for p in folder.glob("seed-*")
                       if p.is_dir() and p.name[5:].isdigit())
        return _comparison(folder, doc, list(doc["methods"]), seeds or None)
    if (folder / "summary.json").is_file():
        return RunResult.read(folder)
    raise FileNotFoundError(f"{folder} holds no summary.json (a run's results) nor compare.json "
                            f"(a comparison's)")


def _comparison(base: Path, doc: dict[str, Any], methods: Sequence[str],
                seeds: Sequence[int] | None) -> CompareResult:
    """The comparison in ``base`` with its runs: ``<method>/``, or ``seed-<s>/<method>/``."""
    folders = {m: [base / method_folder(m)] for m in methods} if seeds is None else {
        m: [base / f"seed-{s}" / method_folder(m) for s in seeds] for m in methods}
    return CompareResult(base, doc, {m: [RunResult.read(f) for f in fs]
                                     for m, fs in folders.items()})
