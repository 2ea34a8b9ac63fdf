"""Time to accuracy and the virtual-time plot, from real rounds.csv files."""

from __future__ import annotations

import pytest

from server.records import RoundRecord
from server.results import write_rounds
from simulations.netem import NetemError
from simulations.netem.report import main, plot_virtual_time, summarize_runs, time_to_accuracy


def _run(tmp_path, name: str, accs: list[float], secs: list[float]):
    d = tmp_path / name
    write_rounds(d, [RoundRecord(i + 1, accuracy=a, uplink_bytes=100 * (i + 1), clients_surplus=1,
                                 extra={"virtual_seconds": s, "dropped_deadline": 0,
                                        "dropped_link": i % 2, "dropped_rejected": 0})
                     for i, (a, s) in enumerate(zip(accs, secs, strict=True))])
    return d


def test_time_to_accuracy_is_the_cumulative_virtual_time_of_the_first_hit(tmp_path,
                                                                          capsys) -> None:
    dense = _run(tmp_path, "dense", [0.5, 0.7, 0.8], [10.0, 10.0, 10.0])
    dgc = _run(tmp_path, "dgc", [0.6, 0.79, 0.81, 0.7], [1.0, 2.0, 3.0, 1.0])
    table = summarize_runs({"dense": dense, "dgc": dgc}, 0.8)
    assert table["dense"]["target_accuracy"] == 0.8
    assert table["dense"]["virtual_seconds_to_target"] == pytest.approx(30.0)
    assert table["dgc"]["virtual_seconds_to_target"] == pytest.approx(6.0)
    assert table["dgc"]["virtual_seconds"] == pytest.approx(7.0)
    assert table["dgc"]["dropped_link"] == 2 and table["dgc"]["uplink_bytes"] == 1000
    assert table["dgc"]["surplus"] == 4 and table["dgc"]["dropped_deadline"] == 0
    from server.results import read_rounds

    assert time_to_accuracy(read_rounds(dgc), 0.9) is None
    out = plot_virtual_time({"dense": dense, "dgc": dgc}, tmp_path / "v.png")
    assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert main([str(tmp_path / "w.png"), f"dense={dense}", f"dgc={dgc}",
                 "--set", "netem.target_accuracy=0.8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head, dense_row, dgc_row = lines[:3]
    # The virtual seconds are the run's total, as labelled (the progress line's "total").
    assert "virtual s total" in head and "surplus" in head
    assert dgc_row.split()[3] == "7.0" and dgc_row.split()[4] == "6.0"
    # Runs without wire or energy columns: words, never nan.
    assert "nan" not in "\n".join(lines) and "n/a" in dgc_row
    assert lines[3].startswith("target accuracy 0.8000 (netem.target_accuracy)")
    assert main([str(tmp_path / "w.png"), f"dense={tmp_path / 'missing'}"]) == 2


def test_the_target_is_the_runs_key_else_the_dense_runs_last10(tmp_path, capsys) -> None:
    """One key for every reading: --set, else the runs' netem.target_accuracy, else dense
    FedAvg's last-10 (the first run's without a dense run); a run that never reached it reads
    "not reached"."""
    import json

    dense = _run(tmp_path, "a", [0.5, 0.7, 0.8], [10.0, 10.0, 10.0])
    dgc = _run(tmp_path, "b", [0.6, 0.65, 0.66, 0.66], [1.0, 2.0, 3.0, 1.0])
    runs = {"first": dgc, "dense": dense}
    # No summaries: the first run's last-10.
    assert summarize_runs(runs)["dense"]["target_accuracy"] == pytest.approx(0.6425)
    (dense / "summary.json").write_text(json.dumps({"method": "dense"}))
    table = summarize_runs(runs)
    assert table["dense"]["target_accuracy"] == pytest.approx(2.0 / 3.0)
    assert table["first"]["virtual_seconds_to_target"] is None
    assert table["dense"]["virtual_seconds_to_target"] == pytest.approx(20.0)
    for d, target in ((dense, 0.6), (dgc, 0.6)):
        (d / "summary.json").write_text(json.dumps({"method": d.name, "netem": {
            "netem.target_accuracy": target}}))
    assert summarize_runs(runs)["dense"]["target_accuracy"] == 0.6
    (dgc / "summary.json").write_text(json.dumps({"netem": {"netem.target_accuracy": 0.7}}))
    with pytest.raises(NetemError, match="different netem.target_accuracy"):
        summarize_runs(runs)
    capsys.readouterr()
    assert main([str(tmp_path / "w.png"), f"first={dgc}", f"dense={dense}",
                 "--set", "netem.target_accuracy=0.75"]) == 0
    out = capsys.readouterr().out
    assert "not reached" in out.splitlines()[1] and "nan" not in out
    for bad in ("netem.target_accuracy=1.5", "netem.deadline_s=3", "netem.target_accuracy"):
        assert main([str(tmp_path / "w.png"), f"dense={dense}", "--set", bad]) == 2
        assert "netem.target_accuracy" in capsys.readouterr().err


def test_a_run_without_the_emulator_is_refused(tmp_path) -> None:
    with pytest.raises(NetemError, match="virtual_seconds"):
        time_to_accuracy([{"accuracy": 0.5}], 0.4)
