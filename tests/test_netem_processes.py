"""Statistical checks of the loss and outage processes against their stationary laws."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.netem import FixedOutages, GilbertElliott, LinkConfigError, MarkovOnOff


def test_gilbert_elliott_long_run_loss_matches_its_stationary_probability() -> None:
    ge = GilbertElliott(p_good_bad=0.02, p_bad_good=0.25, loss_good=0.005, loss_bad=0.6)
    lost = ge.losses(400_000, np.random.default_rng(2024))
    # stationary_bad = 0.02 / 0.27 = 0.0741; loss = 0.9259 * 0.005 + 0.0741 * 0.6 = 0.0491.
    assert ge.stationary_loss == pytest.approx(0.9259259 * 0.005 + 0.0740741 * 0.6, rel=1e-6)
    # Losses are correlated (bursts of ~4 packets), so the tolerance is several times the
    # i.i.d. standard error of 0.00034.
    assert lost.mean() == pytest.approx(ge.stationary_loss, abs=0.003)


def test_gilbert_losses_come_in_bursts_of_the_bad_state() -> None:
    ge = GilbertElliott(p_good_bad=0.01, p_bad_good=0.2)  # Gilbert: G never loses, B always
    lost = ge.losses(300_000, np.random.default_rng(5))
    after_loss = lost[1:][lost[:-1]]
    # Staying in B after a loss has probability 1 - r = 0.8; independent loss would give ~0.05.
    assert after_loss.mean() == pytest.approx(0.8, abs=0.02)
    assert lost.mean() == pytest.approx(0.01 / 0.21, abs=0.005)


def test_packets_sent_until_delivered_matches_the_loss_rate() -> None:
    ge = GilbertElliott(0.05, 0.3, loss_good=0.0, loss_bad=0.5)
    rng = np.random.default_rng(11)
    sent = sum(ge.packets_sent(1000, rng) for _ in range(200))
    delivered = 200 * 1000
    assert 1 - delivered / sent == pytest.approx(ge.stationary_loss, abs=0.01)
    assert ge.packets_sent(0, rng) == 0
    assert GilbertElliott(0.0, 1.0).packets_sent(77, rng) == 77  # never enters the bad state


def test_on_off_duty_cycle_and_mean_outage_match_the_chain() -> None:
    chain = MarkovOnOff(mean_on_s=40.0, mean_off_s=10.0, seed=(1, 2))
    horizon_s = 200_000.0
    assert chain.up_seconds(0.0, horizon_s) / horizon_s == pytest.approx(0.8, abs=0.01)
    offs = []
    for a, b in chain.off_intervals(0.0):
        if a > horizon_s:
            break
        offs.append(b - a)
    assert np.mean(offs) == pytest.approx(10.0, rel=0.05)
    assert len(offs) == pytest.approx(horizon_s / 50.0, rel=0.05)


def test_on_off_chain_is_a_pure_function_of_its_seed() -> None:
    a, b = MarkovOnOff(5.0, 1.0, seed=3), MarkovOnOff(5.0, 1.0, seed=3)
    late = [iv for _, iv in zip(range(5), b.off_intervals(10_000.0), strict=False)]
    early = [iv for _, iv in zip(range(5), a.off_intervals(0.0), strict=False)]
    assert early == [iv for _, iv in zip(range(5), b.off_intervals(0.0), strict=False)]
    assert late == [iv for _, iv in zip(range(5), a.off_intervals(10_000.0), strict=False)]
    assert early != [iv for _, iv in
                     zip(range(5), MarkovOnOff(5.0, 1.0, seed=4).off_intervals(0.0),
                         strict=False)]
    assert a.is_up(late[0][0] - 1e-9) and not a.is_up(late[0][0] + 1e-9)


@pytest.mark.parametrize("kwargs,field", [
    ({"p_good_bad": 1.5}, "p_good_bad"),
    ({"p_bad_good": 0.0}, "p_bad_good"),
    ({"loss_good": 1.0}, "loss_good"),
    ({"loss_bad": -0.1}, "loss_bad"),
    ({"mtu_bytes": 0}, "mtu_bytes"),
])
def test_bad_gilbert_elliott_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LinkConfigError, match=field):
        GilbertElliott(**{"p_good_bad": 0.1, "p_bad_good": 0.5, **kwargs})


def test_bad_outage_values_name_the_field() -> None:
    with pytest.raises(LinkConfigError, match="mean_on_s"):
        MarkovOnOff(0.0, 1.0)
    with pytest.raises(LinkConfigError, match="mean_off_s"):
        MarkovOnOff(1.0, float("inf"))
    with pytest.raises(LinkConfigError, match=r"intervals\[1\]"):
        FixedOutages([(0.0, 2.0), (1.0, 3.0)])
    with pytest.raises(LinkConfigError, match=r"intervals\[0\]"):
        FixedOutages([(2.0, 2.0)])
