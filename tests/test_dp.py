"""Client-level DP-FedAvg (fedgc/privacy/dp): clipping bounds the norm, central noise has std
z*S, adaptive clipping finds its quantile, the distributed discrete Gaussian's sampler and
shares, and the privacy spent checked against dp-accounting's own values computed here."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from flwr.supercore.differential_privacy import compute_adaptive_noise_params

from fedgc.privacy.dp import (
    AdaptiveClip,
    DiscreteGaussianAccountant,
    DistributedDiscreteGaussian,
    GaussianAccountant,
    add_central_noise,
    clip_update,
    clip_vector,
    discrete_gaussian,
    l2_norm,
    subsampled_rdp,
)
from fedgc.privacy.dp.accountant import INTEGER_ORDERS


def test_clipping_bounds_the_norm_and_keeps_the_direction():
    g = torch.Generator().manual_seed(0)
    update = {"w": torch.randn(30, 20, generator=g) * 5, "b": torch.randn(20, generator=g)}
    clipped, norm = clip_update(update, 1.5)
    assert norm == pytest.approx(l2_norm(update)) and norm > 1.5
    assert l2_norm(clipped) == pytest.approx(1.5, rel=1e-6)
    assert torch.allclose(clipped["w"] * norm / 1.5, update["w"], rtol=1e-5)
    small = {"w": torch.full((3,), 0.1)}
    assert clip_update(small, 1.5)[0]["w"] is small["w"]  # within the norm: untouched
    v, before = clip_vector(np.full(100, 2.0), 4.0)
    assert before == pytest.approx(20.0) and np.linalg.norm(v) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        clip_update({"w": torch.tensor([float("nan")])}, 1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        clip_vector(np.ones(3), 0.0)


def test_central_noise_has_std_z_times_s():
    rng = np.random.default_rng(1)
    total = np.linspace(-1, 1, 400_000)
    noised = add_central_noise(total, noise_multiplier=1.3, clip_norm=0.7, rng=rng)
    noise = noised - total
    assert abs(noise.mean()) < 0.005
    assert noise.std() == pytest.approx(1.3 * 0.7, rel=0.01)


@pytest.mark.parametrize("quantile", [0.5, 0.8])
@pytest.mark.parametrize("start", [0.01, 100.0])
def test_adaptive_clipping_moves_the_clip_to_the_target_quantile(quantile, start):
    rng = np.random.default_rng(2)
    clip = AdaptiveClip.for_clients(100, clip=start, target_quantile=quantile)
    # Update norms of a lognormal spread (median 1); 300 rounds of 100 clients each.
    for _ in range(300):
        norms = rng.lognormal(0.0, 0.5, 100)
        clip.update(sum(clip.bit(n) for n in norms), 100, rng)
    want = float(np.exp(0.5 * math.sqrt(2) * _erfinv(2 * quantile - 1)))
    assert clip.clip == pytest.approx(want, rel=0.15)
    assert clip.history[0] == start


def _erfinv(y: float) -> float:
    from scipy.special import erfinv

    return float(erfinv(y))


def test_adaptive_clipping_keeps_the_total_noise_multiplier():
    clip = AdaptiveClip.for_clients(100)
    z = 1.0
    # Flower computes the same split of noise between update and bits.
    assert clip.update_noise_multiplier(z) == pytest.approx(
        compute_adaptive_noise_params(z, 100, None)[1])
    # The bits' noise and the update's together are one Gaussian of multiplier z.
    z_u, sigma_b = clip.update_noise_multiplier(z), clip.count_noise
    assert (z_u ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)
    with pytest.raises(ValueError, match="must exceed"):
        AdaptiveClip(count_noise=0.4).update_noise_multiplier(1.0)
    state = clip.state_dict()
    again = AdaptiveClip()
    again.load_state_dict(state)
    assert again.clip == clip.clip


# ---------------------------------------------------------------------- the accountant
def _library_epsilon(z: float, q: float, rounds: int, delta: float, kind: str = "rdp") -> float:
    """dp-accounting's epsilon for these parameters, built here from its public API."""
    accountant = rdp.RdpAccountant() if kind == "rdp" else pld.PLDAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("z,q,rounds", [(1.1, 0.01, 500), (0.8, 0.1, 50), (2.0, 1.0, 20)])
def test_the_accountant_s_epsilon_is_the_library_s_for_the_same_parameters(z, q, rounds):
    accountant = GaussianAccountant(1e-5)
    history = []
    for _ in range(rounds):
        accountant.record(z, q)
        if len(history) < 2:
            history.append(accountant.epsilon())
    assert accountant.epsilon() == pytest.approx(_library_epsilon(z, q, rounds, 1e-5),
                                                 rel=1e-9)
    assert history == sorted(history) and accountant.rounds == rounds
    g = accountant.guarantee()
    assert g.delta == 1e-5 and "Poisson sampling" in g.statement and "client" in g.statement
    # The checkpoint rebuilds it.
    again = GaussianAccountant(1e-5)
    again.load_state_dict(accountant.state_dict())
    assert again.epsilon() == accountant.epsilon()
    with pytest.raises(ValueError, match="delta"):
        GaussianAccountant(1e-6).load_state_dict(accountant.state_dict())


def test_the_pld_accountant_is_the_library_s_and_tighter_than_rdp():
    accountant = GaussianAccountant(1e-5, kind="pld")
    accountant.record(1.5, 0.05, 30)
    epsilon = accountant.epsilon()
    assert epsilon == pytest.approx(_library_epsilon(1.5, 0.05, 30, 1e-5, "pld"), rel=1e-6)
    assert epsilon < _library_epsilon(1.5, 0.05, 30, 1e-5)


def test_without_sampling_the_epsilon_is_below_the_classic_rdp_conversion():
    # The Gaussian mechanism has RDP a / (2 z^2) per round; the classic conversion
    # eps = min_a T a / (2 z^2) + log(1/delta) / (a - 1) is what the library improves on.
    z, rounds, delta = 3.0, 40, 1e-5
    classic = min(rounds * a / (2 * z * z) + math.log(1 / delta) / (a - 1)
                  for a in np.linspace(1.01, 200, 20000))
    accountant = GaussianAccountant(delta)
    accountant.record(z, 1.0, rounds)
    assert 0.8 * classic < accountant.epsilon() <= classic


def test_the_sampling_bound_is_above_the_exact_subsampled_gaussian_and_close():
    z, orders = 1.0, INTEGER_ORDERS
    gaussian = [a / (2 * z * z) for a in range(2, max(orders) + 1)]
    for q, rounds in ((0.01, 1000), (0.1, 100)):
        bound = subsampled_rdp(gaussian, orders, q) * rounds
        ours = rdp.rdp_privacy_accountant.compute_epsilon(orders, bound, 1e-5)[0]
        exact = rdp.RdpAccountant(orders)
        exact.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
                      rounds)
        assert exact.get_epsilon(1e-5) <= ours <= 1.3 * exact.get_epsilon(1e-5)


# ---------------------------------------------------------------------- distributed noise
def test_the_discrete_gaussian_sampler_has_its_distribution():
    sigma = 2.5
    draws = discrete_gaussian(sigma, 400_000, np.random.default_rng(3))
    assert draws.dtype == np.int64
    k = np.arange(-80, 81)
    pmf = np.exp(-k * k / (2 * sigma * sigma))
    pmf /= pmf.sum()
    assert abs(draws.mean()) < 0.02
    assert draws.var() == pytest.approx(float((pmf * k * k).sum()), rel=0.015)
    assert np.mean(draws == 0) == pytest.approx(float(pmf[80]), rel=0.02)


def _ddg(**kw) -> DistributedDiscreteGaussian:
    return DistributedDiscreteGaussian(**{"clip_norm": 1.0, "step": 1 / 64,
                                          "noise_multiplier": 1.0, "min_clients": 10,
                                          "dimension": 400, **kw})


def test_distributed_shares_round_within_the_sensitivity_and_sum_to_the_target_noise():
    mech = _ddg()
    rng = np.random.default_rng(4)
    for _ in range(20):
        v = rng.normal(size=400) * 10  # far beyond the clip: clipped first
        ints = mech.discretize(v, rng)
        assert np.linalg.norm(ints) <= mech.sensitivity
        assert np.linalg.norm(ints) > 0.9 * mech.clip_norm / mech.step
    # Ten shares of zeros: the sum's noise std is z * sensitivity (in integer steps).
    total = sum(mech.privatize(np.zeros(400), rng) for _ in range(10))
    assert total.std() == pytest.approx(mech.noise_multiplier * mech.sensitivity, rel=0.1)
    assert np.abs(total).max() < mech.sum_bound(10)
    assert mech.min_modulus_bits(10) == mech.sum_bound(10).bit_length() + 1


def test_the_distributed_guarantee_is_the_gaussian_s_when_tau_vanishes_and_worse_with_fewer():
    mech = _ddg()
    assert mech.tau(10) < 1e-12  # shares of ~20 integer steps: the sum is a Gaussian's
    rounds, delta = 30, 1e-5
    ddg = DiscreteGaussianAccountant(delta, mech)
    ddg.record(10, 1.0, rounds)
    # The Gaussian with the same ratio of noise to sensitivity, in the library, same orders.
    z_equiv = math.sqrt(10) * mech.local_std / mech.sensitivity
    gaussian = rdp.RdpAccountant(INTEGER_ORDERS)
    gaussian.compose(dp_accounting.GaussianDpEvent(z_equiv), rounds)
    assert ddg.epsilon() == pytest.approx(gaussian.get_epsilon(delta), rel=1e-9)
    assert z_equiv == pytest.approx(mech.noise_multiplier)
    # Fewer survivors than the shares were sized for: less noise, more privacy spent.
    fewer = DiscreteGaussianAccountant(delta, mech)
    fewer.record(6, 1.0, rounds)
    assert fewer.epsilon() > ddg.epsilon()
    # Tiny shares (below an integer step): tau no longer vanishes, and it costs.
    coarse = _ddg(step=1.0, noise_multiplier=0.05, clip_norm=4.0)
    assert coarse.local_std < 0.5 and coarse.tau(10) > 1e-3
    sampled = DiscreteGaussianAccountant(delta, mech)
    sampled.record(10, 0.05, rounds)
    assert 0 < sampled.epsilon() < ddg.epsilon()
    assert "distributed discrete Gaussian" in sampled.guarantee().statement
