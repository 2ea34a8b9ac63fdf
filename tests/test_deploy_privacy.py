"""Secure aggregation and distributed DP on a real deployment (docs/privacy.md): SuperNodes over
shaped links, TLS and node authentication, every stage a Flower message, and the capture's
attribution of each stage's bytes. Slow: a ClientApp process starts for every message."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from simulations.deploy.capture import missing_reason
from simulations.deploy.cli import main

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]


def test_a_secure_deployment_with_distributed_noise_sums_every_round(tmp_path: Path) -> None:
    """digits, dgc_sets, 3 SuperNodes on LTE links, TLS and node authentication, 2 rounds,
    secure aggregation with distributed noise, captured."""
    results = tmp_path / "results"
    argv = ["--nodes", "3", "--link", "lte", "--auth", "--capture", "--workdir",
            str(tmp_path / "work"), "--set", f"results_dir={results}", "--set", "run_name=sa"]
    for key, value in {"task": "digits", "method": "dgc_sets", "rounds": "2", "seed": "0",
                       "round_timeout_s": "120", "progress": "false", "privacy.secagg": "true",
                       "privacy.dp": "distributed", "privacy.clip": "0.5",
                       "privacy.noise_multiplier": "1.0"}.items():
        argv += ["--set", f"{key}={value}"]
    assert main(argv) == 0
    run = results / "sa"
    with (run / "rounds.csv").open(newline="") as fh:
        rounds = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rounds] == [1, 2]
    assert [int(r["secagg_clients"]) for r in rounds] == [3, 3]
    assert all(float(r["dp_epsilon"]) > 0 for r in rounds)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["robust"] == "off" and summary["config"]["aggregation"] == "mean"
    ledger = json.loads((run / "wire.json").read_text())
    assert ledger["attributed_fraction"]["up"] > 0.98 < ledger["attributed_fraction"]["down"]
    stages = ledger["secagg_stages"]
    # Each stage: a request and a reply per node and round (2 x 3 x 2).
    for stage in ("setup", "share_keys", "masked_vector", "unmask"):
        assert stages[stage]["messages"] == 12, (stage, stages[stage])
        for d in ("up", "down"):
            assert stages[stage]["bytes"][d]["payload"] > 0
    own = {d: sum(sum(stages[s]["bytes"][d].values()) for s in ("setup", "share_keys",
                                                                  "unmask"))
           for d in ("up", "down")}
    assert stages["exchange_bytes"] == own
    # The stages' payload on the wire is what the server counted: the setup, share-keys and
    # unmask messages both ways and the forwarded shares in the train messages.
    payload = sum(stages[s]["bytes"][d]["payload"] for s in ("setup", "share_keys", "unmask")
                  for d in ("up", "down"))
    forwarded = (stages["masked_vector"]["bytes"]["down"]["payload"]
                 - ledger["payload_clients_csv"]["down"])
    assert payload + forwarded == sum(int(r["secagg_overhead_bytes"]) for r in rounds)
