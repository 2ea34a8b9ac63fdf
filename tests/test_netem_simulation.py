"""The emulator in a real Flower simulation (Ray backend), from the command line."""

from __future__ import annotations

import csv
import json

import pytest

from simulations.cli import main


@pytest.mark.slow
def test_cli_run_with_netem_writes_virtual_time_and_drops(tmp_path) -> None:
    # Two rounds (three before): each row's accounting is checked on its own, and the summary's
    # virtual time must be the sum of both rows, not the first's or the last's. One Ray CPU,
    # so one ClientApp actor (each imports torch and fedgc), which the emulator's ClientApp
    # wrapper runs in as in any number of them.
    rc = main(["run", "--set", "sim.num_cpus=1", "--set", "task=digits", "--set",
               "num_clients=12", "--set", "clients_per_round=4", "--set", "over_selection=1.5",
               "--set", "rounds=2",
               "--set", f"results_dir={tmp_path}", "--set", "run_name=emu", "--set",
               "density=0.05", "--set", "netem.enabled=true", "--set",
               "netem.mix=3g:0.5,edge:0.5", "--set", "netem.intermittent=0.5", "--set",
               "netem.deadline_s=30", "--set", "netem.target_accuracy=0.05"])
    assert rc == 0
    with (tmp_path / "emu" / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2
    for r in rows:
        assert 0 < float(r["virtual_seconds"]) <= 30.0 + 1e-9
        dropped = int(r["dropped_deadline"]) + int(r["dropped_link"])
        assert int(r["clients_aggregated"]) + int(r["clients_surplus"]) + dropped \
            + int(r["dropped_rejected"]) == 6
    summary = json.loads((tmp_path / "emu" / "summary.json").read_text())
    assert summary["virtual_seconds"] == pytest.approx(sum(float(r["virtual_seconds"])
                                                           for r in rows))
    assert summary["virtual_seconds_to_target"] == pytest.approx(float(rows[0]["virtual_seconds"]))


def test_bad_netem_key_stops_with_its_name(capsys) -> None:
    assert main(["run", "--set", "netem.mix=lte:0.7"]) == 2
    assert "netem.mix" in capsys.readouterr().err
