"""The radio power model against a timeline worked out by hand, and bad power-model files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from simulations.cli import main
from simulations.netem.energy import (
    POWER_MODELS,
    PowerModelError,
    Transfer,
    compute_energy_j,
    load_power_models,
    radio_energy,
)

LTE = POWER_MODELS["lte"]


def test_lte_timeline_worked_by_hand() -> None:
    """Promotion + transfer + tail on LTE (1210.7 mW for 260.1 ms; 1288.04 mW + 438.39 mW per
    Mbit/s up + 51.97 mW per Mbit/s down; 1060 mW tail for 11.576 s), by hand:

    A [0, 1] s up 1 Mbit (1 Mbit/s), B [0.5, 1.5] s down 2 Mbit (2 Mbit/s), overlapping;
    C [5, 5.5] s up 0.5 Mbit (1 Mbit/s), within B's tail; D [30, 31] s down 1 Mbit, after the
    radio went idle (24.5 s > 11.576 s).

    - promotion (A, and D): 1.2107 W * 0.2601 s = 0.31490307 J
    - [0, 0.5]: A alone, (1.28804 + 0.43839) W * 0.5 s = 0.863215 J -> A
    - [0.5, 1]: A and B, (1.28804 + 0.43839 + 2 * 0.05197) W * 0.5 s = 0.915185 J, shared by
      bits 1:2 -> A 0.30506167, B 0.61012333
    - [1, 1.5]: B alone, (1.28804 + 2 * 0.05197) W * 0.5 s = 0.69599 J -> B
    - tail B..C (merged, cut by C): 1.06 W * 3.5 s = 3.71 J -> B
    - C: (1.28804 + 0.43839) W * 0.5 s = 0.863215 J, no promotion
    - tail after C, full: 1.06 W * 11.576 s = 12.27056 J -> C
    - D: (1.28804 + 0.05197) W * 1 s = 1.34001 J, then its full tail 12.27056 J
    """
    a = Transfer(0.0, 1.0, up_bytes=125_000)
    b = Transfer(0.5, 1.5, down_bytes=250_000)
    c = Transfer(5.0, 5.5, up_bytes=62_500)
    d = Transfer(30.0, 31.0, down_bytes=125_000)
    e = radio_energy(LTE, [c, a, d, b])  # any order: results follow the order given
    promotion = 1.2107 * 0.2601
    expected = {
        "c": 0.863215 + 1.06 * 11.576,
        "a": promotion + 0.863215 + 0.915185 / 3,
        "d": promotion + 1.34001 + 1.06 * 11.576,
        "b": 0.915185 * 2 / 3 + 0.69599 + 1.06 * 3.5,
    }
    for i, name in enumerate("cad b".replace(" ", "")):
        assert e.total(i) == pytest.approx(expected[name], rel=1e-9), name
    assert e.promotions == 2
    assert e.promotion_j == pytest.approx([0.0, promotion, promotion, 0.0])
    assert e.total_j == pytest.approx(sum(expected.values()), rel=1e-9)
    # A window that ends 4 s after D cuts D's tail there.
    cut = radio_energy(LTE, [a, b, c, d], until_s=35.0)
    assert cut.total(3) == pytest.approx(promotion + 1.34001 + 1.06 * 4.0, rel=1e-9)


def test_a_message_every_few_seconds_keeps_the_radio_out_of_idle() -> None:
    """Polls every 3 s on LTE: one promotion, and the tail between them is paid in full."""
    polls = [Transfer(3.0 * k, 3.0 * k + 0.05, up_bytes=600, down_bytes=300) for k in range(20)]
    e = radio_energy(LTE, polls)
    assert e.promotions == 1
    tail = sum(e.tail_j)
    assert tail == pytest.approx(1.06 * (19 * 2.95 + 11.576), rel=1e-9)


def test_compute_energy() -> None:
    assert compute_energy_j(2.0, 1.5) == 3.0
    with pytest.raises(PowerModelError, match=r"compute seconds must be a finite number >= 0, "
                                              r"got nan"):
        compute_energy_j(2.0, float("nan"))


@pytest.mark.parametrize(("field", "value"), [("start_s", -1.0), ("up_bytes", float("nan"))])
def test_a_bad_timeline_value_is_named(field: str, value: float) -> None:
    args = {"start_s": 0.0, "end_s": 1.0, field: value}
    with pytest.raises(PowerModelError, match=rf"Transfer.{field} must be a finite number >= 0"):
        Transfer(**args)
    with pytest.raises(PowerModelError, match=r"Transfer.end_s must be >= start_s"):
        Transfer(2.0, 1.0)


GOOD = ('{"lte": {"promotion_mw": 1000, "promotion_ms": 200, "tail_mw": 900, "tail_ms": 5000, '
        '"up_mw_per_mbps": 400, "down_mw_per_mbps": 50, "base_mw": 1200}}')


@pytest.mark.parametrize(("content", "message"), [
    (None, r"missing.json: cannot read the power model \(No such file or directory\)"),
    (GOOD[:60], r"bad.json: not a JSON object of power models"),
    ("[1, 2]", r"bad.json: expected a JSON object of technology -> model"),
    (GOOD.replace('"tail_mw": 900', '"tail_mw": -1'),
     r"bad.json: lte.tail_mw must be a finite number >= 0, got -1"),
    (GOOD.replace('"up_mw_per_mbps": 400', '"up_mw_per_mbps": NaN'),
     r"bad.json: not a JSON object of power models \(NaN is not a number JSON allows"),
    (GOOD.replace('"tail_ms": 5000, ', ''), r"bad.json: lte lacks field 'tail_ms'"),
])
def test_a_bad_power_model_file_is_named(tmp_path: Path, content: str | None,
                                         message: str) -> None:
    path = tmp_path / "missing.json"
    if content is not None:
        path = tmp_path / "bad.json"
        path.write_text(content)
    with pytest.raises(PowerModelError, match=message):
        load_power_models(path)


def test_a_power_model_file_replaces_a_preset(tmp_path: Path) -> None:
    path = tmp_path / "radio.json"
    path.write_text(GOOD)
    models = load_power_models(path)
    assert models["lte"].tail_ms == 5000.0 and models["3g"] == POWER_MODELS["3g"]


def test_a_bad_power_model_stops_the_run_before_round_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "radio.json"
    bad.write_text(GOOD.replace('"base_mw": 1200', '"base_mw": -5'))
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=2", "--set", "clients_per_round=2", "--set", "rounds=1",
            "--set", "netem.enabled=true",
            "--set", f"netem.power_model={bad}", "--set", f"results_dir={tmp_path / 'r'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(r"netem.power_model = .*radio.json.*lte.base_mw must be a finite number "
                     r">= 0, got -5", err), err
    assert not (tmp_path / "r").exists()
