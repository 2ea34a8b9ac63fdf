"""Mahimahi trace files from the run config: ``netem.trace_down``/``netem.trace_up`` and the
``trace`` link preset; bad files are named before round 1."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from fedgc.settings import SettingsError
from simulations.cli import main
from simulations.netem.settings import NetemSettings

RUN = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set", "num_clients=4",
       "--set", "clients_per_round=2", "--set", "rounds=2", "--set", "progress=false",
       "--set", "density=0.05", "--set", "netem.enabled=true",
       "--set", "netem.mix=trace:1.0", "--set", "netem.trace_latency_ms=0",
       # Every client is sent the dense model, so that its bytes dominate each download.
       "--set", "downlink_density=1", "--set", "clients_build_initial_model=false"]


def _mahimahi(path: Path, every_ms: int, period_ms: int = 1000) -> Path:
    """One 1500-byte delivery opportunity every ``every_ms`` ms: 12/every_ms Mbit/s."""
    path.write_text("".join(f"{t}\n" for t in range(every_ms, period_ms + 1, every_ms)))
    return path


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def _virtual_seconds(run: Path) -> float:
    """The run's virtual time: the sum of its rounds'."""
    return sum(float(r["virtual_seconds"]) for r in _rows(run / "rounds.csv"))


def test_a_trace_link_runs_at_the_traces_rate(tmp_path: Path) -> None:
    """The same run with a 12 Mbit/s and a 0.12 Mbit/s downlink trace: the slow one takes longer
    by the time each round's largest download needs at 0.12 Mbit/s (the run's own bytes)."""
    fast_down = _mahimahi(tmp_path / "fast.down", 1)
    slow_down = _mahimahi(tmp_path / "slow.down", 100)
    up = _mahimahi(tmp_path / "up", 1)
    for name, down in (("fast", fast_down), ("slow", slow_down)):
        argv = [*RUN, "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}",
                "--set", f"netem.trace_down={down}", "--set", f"netem.trace_up={up}"]
        assert main(argv) == 0
    clients = _rows(tmp_path / "slow" / "clients.csv")
    largest = [max(int(c["downlink_bytes"]) for c in clients if c["round"] == str(r))
               for r in (1, 2)]
    # 12 Mbit/s moves a 60 kB model in 0.04 s, 0.12 Mbit/s in 4 s. The message also carries
    # the run's config (under 2 kB: 0.13 s at 0.12 Mbit/s), and the Mahimahi trace delivers
    # whole 1500-byte packets at 100 ms steps, so a transfer may end up to 0.1 s later.
    expected = sum(b * 8 / 0.12e6 for b in largest)
    extra = _virtual_seconds(tmp_path / "slow") - _virtual_seconds(tmp_path / "fast")
    assert expected > 7.0
    assert expected * 0.98 < extra < expected + len(largest) * (2000 * 8 / 0.12e6 + 0.1)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"netem.trace_down = '.*missing': cannot read the trace file"),
    ("10\nabc\n", r"netem.trace_down = .*:2: expected one integer millisecond"),
    ("", r"netem.trace_down = .* has no samples"),
    ("0\n", r"netem.trace_down = .* must end after 0 ms"),
    # Issue 26: a digit int() refuses, timestamps past int64 or int()'s 4,300 digits, and one
    # that made a round take 1.3e16 virtual seconds.
    ("10\n\u00b2\n", r"netem.trace_down = .*:2: expected one integer millisecond"),
    ("0\n99999999999999999999\n", r":2: timestamp '99999999999999999999' ms is past"),
    ("0\n" + "1" * 5000 + "\n", r":2: timestamp '1111.*'\.\.\. ms is past the longest"),
    ("0\n9223372036854775807\n", r"ms is past the longest trace period, 2592000000 ms"),
    ("0\n2592000001\n", r"loops every 2\.592e\+06 s; expected at most"),
    # A throughput trace: a rate that overflowed the integration to NaN, and a trickle.
    ("0 1e308\n1 1e308\n", r"sample 0 has rate 1e\+308 Mbit/s; rates must be in \[0, 1e\+06\]"),
    ("0 0.0000001\n1 0\n", r"averages 5e-08 Mbit/s over its period; expected at least"),
])
def test_a_bad_trace_file_is_named_before_round_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
        message: str) -> None:
    down = tmp_path / "missing"
    if content is not None:
        down = tmp_path / "bad.down"
        down.write_text(content)
    up = _mahimahi(tmp_path / "up", 1)
    argv = [*RUN, "--set", f"results_dir={tmp_path}", "--set", f"netem.trace_down={down}",
            "--set", f"netem.trace_up={up}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "default").exists()


def test_trace_keys_and_the_mix_must_agree(tmp_path: Path) -> None:
    up = _mahimahi(tmp_path / "up", 1)
    with pytest.raises(SettingsError, match=r"names the 'trace' link, which needs "
                                            r"netem.trace_down \(trace files\)"):
        NetemSettings(mix="trace:1.0", trace_up=str(up))
    with pytest.raises(SettingsError, match=r"netem.trace_down, netem.trace_up set, but "
                                            r"netem.mix = 'lte:1.0' does not name"):
        NetemSettings(mix="lte:1.0", trace_down=str(up), trace_up=str(up))
    with pytest.raises(SettingsError, match=r"netem.trace_up = '.*' is not a file"):
        NetemSettings(mix="trace:1.0", trace_down=str(up), trace_up=str(tmp_path))
    mixed = NetemSettings(mix="trace:0.5,3g:0.5", trace_down=str(up), trace_up=str(up),
                          num_clients=4)
    assert mixed.assignment().counts() == {"trace": 2, "3g": 2}
