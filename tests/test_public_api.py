"""``import fedgc``: the public API (run, compare, results) without importing the simulations
or torch until used; ``fedgc.results`` reads a run or a comparison back from its folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fedgc
from simulations import api

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "runs"


def test_import_fedgc_is_light_and_the_api_is_simulations_api() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, fedgc; print(sorted(m for m in ('torch', 'flwr', "
                               "'simulations') if m in sys.modules), sorted(fedgc.__all__))"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert loaded == "[] ['CompareResult', 'RunResult', 'compare', 'results', 'run']"
    assert (fedgc.run, fedgc.compare, fedgc.results) == (api.run, api.compare, api.results)
    with pytest.raises(AttributeError, match="has no attribute 'runs'"):
        fedgc.runs  # noqa: B018


def test_results_reads_a_run_and_a_comparison_back(tmp_path: Path) -> None:
    run = fedgc.results(GOLDEN / "dgc_int8")
    assert isinstance(run, fedgc.RunResult) and run.summary["rounds"] == len(run.rounds) == 6
    # A comparison's folder: compare.json and a run folder per method.
    base = tmp_path / "cmp"
    for method, golden in (("dgc", "dgc_int8"), ("dense", "netem_drop")):
        shutil.copytree(GOLDEN / golden, base / method)
    (base / "compare.json").write_text(json.dumps({"methods": {"dgc": {}, "dense": {}}}))
    both = fedgc.results(base)
    assert isinstance(both, fedgc.CompareResult) and both.folder == base
    assert {m: [r.folder for r in rs] for m, rs in both.runs.items()} == {
        "dgc": [base / "dgc"], "dense": [base / "dense"]}
    # With seeds, one run per seed folder.
    seeded = tmp_path / "seeds"
    for seed in (0, 1):
        shutil.copytree(GOLDEN / "dgc_int8", seeded / f"seed-{seed}" / "dgc")
    (seeded / "compare.json").write_text(json.dumps({"methods": {"dgc": {}}}))
    assert [r.folder.parent.name for r in fedgc.results(seeded).runs["dgc"]] == ["seed-0",
                                                                                  "seed-1"]
    with pytest.raises(FileNotFoundError, match="nothing.*no summary.json"):
        fedgc.results(tmp_path / "nothing")
