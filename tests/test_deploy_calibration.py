"""Calibration: a transfer on the shaped real link matches the analytic prediction within 15%."""

from __future__ import annotations

import pytest

from simulations.deploy.calibrate import measure, predicted_transfer_s
from simulations.deploy.links import choose_mode
from simulations.deploy.netns import probe_capabilities
from simulations.deploy.presets import preset

BEST_MODE, _ = choose_mode("auto", probe_capabilities())
MODES = sorted({BEST_MODE, "proxy"})


def test_prediction_is_one_round_trip_plus_serialisation() -> None:
    spec = preset("3g")
    assert predicted_transfer_s(spec, 0, "up") == pytest.approx(spec.rtt_ms / 1000)
    assert predicted_transfer_s(spec, 1_000_000, "down") == pytest.approx(
        spec.rtt_ms / 1000 + 8.0 / spec.down_mbps
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("name", "payload_bytes", "direction"),
    [("lte", 250_000, "up"), ("3g", 120_000, "down"), ("edge", 20_000, "up")],
)
def test_shaped_transfer_matches_prediction(
    mode: str, name: str, payload_bytes: int, direction: str
) -> None:
    point = measure(preset(name), mode, payload_bytes, direction, seed=3, repeats=2)
    assert point.mode == mode
    assert abs(point.relative_error) < 0.15, point
