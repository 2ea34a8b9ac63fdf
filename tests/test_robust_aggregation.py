"""Robust aggregation (issue 26 item 1): centered clipping and FLTrust on sparse payloads equal
their dense definitions, bound what one client moves, keep their state across a checkpoint, and
``robust`` chooses plain FedAvg for simulations and the robust profile for deployments."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import dgc
from dgc import SparseTensor, SparseUpdate
from fedgc.methods import SparsePayload
from fedgc.settings import ROBUST_PROFILES, RunConfig, SettingsError
from server.aggregation import Combine, trimmed_count
from server.checkpoint import check_run_config
from server.robust import CenteredClip, buckets, client_entries, fltrust, space_offsets

SHAPES = {"w": (6, 5), "b": (7,)}
SIZE = 37


def _client(g: torch.Generator, density: float, scale: float = 1.0) -> list[SparseUpdate]:
    """An update and, overlapping it, a second part (a client's signs)."""
    parts = []
    for _ in range(2):
        tensors = {}
        for name, shape in SHAPES.items():
            n = math.prod(shape)
            idx = torch.randperm(n, generator=g)[: max(1, int(density * n))].sort().values
            tensors[name] = SparseTensor(idx, scale * torch.randn(idx.numel(), generator=g),
                                         shape)
        parts.append(SparseUpdate(tensors, 1))
    return parts


def _dense(parts: list[SparseUpdate]) -> torch.Tensor:
    return torch.cat([sum(p.to_dense(torch.float64)[n] for p in parts).reshape(-1)
                      for n in SHAPES])


def _entries(clients: list[list[SparseUpdate]], factors: list[float] | None = None):
    offsets, _ = space_offsets(SHAPES)
    factors = factors or [1.0] * len(clients)
    return [client_entries(c, f, offsets) for c, f in zip(clients, factors, strict=True)]


def _centered_clip_dense(xs: torch.Tensor, weights: list[float], center: torch.Tensor,
                         ratio: float, iterations: int) -> torch.Tensor:
    """Centered clipping on dense rows, as the paper writes it."""
    shares = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    v = center.clone()
    for _ in range(iterations):
        diff = xs - v
        dist = diff.norm(dim=1)
        tau = ratio * dist.median() if len(xs) % 2 else ratio * dist.sort().values[
            len(xs) // 2 - 1: len(xs) // 2 + 1].mean()
        scale = torch.clamp(tau / dist, max=1.0)
        v = v + (shares[:, None] * scale[:, None] * diff).sum(dim=0)
    return v


@pytest.mark.parametrize("k, density, ratio, iterations", [
    (5, 0.3, 1.0, 3), (6, 0.6, 0.5, 1), (7, 1.0, 2.0, 4)])
def test_sparse_centered_clip_equals_its_dense_definition(k, density, ratio, iterations):
    g = torch.Generator().manual_seed(k)
    clients = [_client(g, density) for _ in range(k)]
    weights = [float(w) for w in torch.randint(1, 50, (k,), generator=g)]
    center = torch.randn(SIZE, generator=g, dtype=torch.float64)
    cc = CenteredClip(ratio, iterations)
    cc.center = center.clone()
    got = cc(_entries(clients), weights, SIZE)
    want = _centered_clip_dense(torch.stack([_dense(c) for c in clients]), weights, center,
                                ratio, iterations)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    torch.testing.assert_close(cc.center, got)  # the next round's center


def test_centered_clip_without_clipping_is_the_weighted_mean():
    """With a radius no client reaches, a step is FedAvg's weighted mean, whatever the
    center."""
    g = torch.Generator().manual_seed(3)
    clients = [_client(g, 0.4) for _ in range(5)]
    weights = [3.0, 10.0, 1.0, 7.0, 2.0]
    payloads = [SparsePayload(c[0], c[1:]) for c in clients]
    mean = Combine("mean")(payloads, weights, [1.0] * 5, SHAPES)
    robust = Combine("centered_clip", clip_radius=1e9, clip_iterations=1)
    robust.centered.center = torch.randn(SIZE, generator=g, dtype=torch.float64)
    got = robust(payloads, weights, [1.0] * 5, SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(got[n], mean[n], rtol=0, atol=1e-6)


def test_one_client_moves_a_centered_clip_by_its_share_of_the_radius_at_most():
    """A hostile update sent at 1e6 or at 1e30 times an honest one's size gives the same
    aggregate: beyond the radius its term is its weight share times the radius, whatever it
    sends."""
    import statistics

    g = torch.Generator().manual_seed(4)
    honest = [_client(g, 1.0) for _ in range(9)]
    direction = _client(g, 1.0)
    got = {}
    for scale in (1e6, 1e30):
        hostile = [SparseUpdate({n: SparseTensor(t.indices, t.values * scale, t.shape)
                                 for n, t in p.tensors.items()}, 1) for p in direction]
        got[scale] = CenteredClip(1.0, 1)(_entries([*honest, hostile]), [1.0] * 10, SIZE)
    torch.testing.assert_close(got[1e6], got[1e30], rtol=1e-5, atol=1e-7)
    xs = [_dense(c) for c in honest]  # the center is 0 in round 1: distances are norms
    tau = statistics.median([float(x.norm()) for x in xs] + [math.inf])
    honest_terms = sum(x * min(1.0, tau / float(x.norm())) / 10 for x in xs)
    assert float((got[1e30] - honest_terms).norm()) == pytest.approx(tau / 10, rel=1e-9)


def test_fltrust_equals_its_dense_definition_and_ignores_flipped_and_scaled_copies():
    g = torch.Generator().manual_seed(5)
    clients = [_client(g, 0.5) for _ in range(6)]
    root = torch.randn(SIZE, generator=g, dtype=torch.float64)
    got = fltrust(_entries(clients), root)
    xs = torch.stack([_dense(c) for c in clients])
    trust = torch.relu(xs @ root / (xs.norm(dim=1) * root.norm()))
    want = (trust[:, None] * xs * (root.norm() / xs.norm(dim=1))[:, None]).sum(0) / trust.sum()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    flipped = [[SparseUpdate({n: SparseTensor(t.indices, -t.values, t.shape)
                              for n, t in p.tensors.items()}, 1) for p in c] for c in clients
               if float(_dense(c) @ root) > 0]
    assert flipped  # some point along the root update; their flips point away from it
    torch.testing.assert_close(fltrust(_entries(clients + flipped), root), got)
    scaled = [[SparseUpdate({n: SparseTensor(t.indices, 1e12 * t.values, t.shape)
                             for n, t in p.tensors.items()}, 1) for p in clients[0]]]
    with_scaled = fltrust(_entries(clients + scaled), root)
    with_copy = fltrust(_entries(clients + clients[:1]), root)
    # The same but for the rounding of the float32 values scaled by 1e12.
    torch.testing.assert_close(with_scaled, with_copy, rtol=1e-6, atol=1e-7)


def test_fltrust_refuses_a_round_where_no_update_agrees_with_the_root():
    g = torch.Generator().manual_seed(6)
    clients = [_client(g, 1.0) for _ in range(3)]
    root = -sum(_dense(c) for c in clients)  # every update points away from it
    entries = _entries(clients)
    assert all(float(v @ root[i]) < 0 for i, v in entries)
    with pytest.raises(dgc.AggregationError, match="no update agrees"):
        fltrust(entries, root)
    with pytest.raises(dgc.AggregationError, match="root update is zero"):
        fltrust(entries, torch.zeros(SIZE, dtype=torch.float64))


@pytest.mark.parametrize("how, fraction, k, cut", [
    ("trimmed_mean", 0.1, 5, 1), ("trimmed_mean", 0.1, 10, 1), ("trimmed_mean", 0.2, 10, 2),
    ("trimmed_mean", 0.0, 10, 0), ("trimmed_mean", 0.4, 3, 1), ("trimmed_mean", 0.3, 2, 0),
    ("median", 0.0, 6, 2), ("median", 0.0, 7, 3)])
def test_a_trimmed_mean_above_zero_cuts_at_least_one_client(how, fraction, k, cut):
    """Issue 26: at 5 clients a round, trim_fraction 0.1 trimmed nothing."""
    assert trimmed_count(how, fraction, k) == cut


def test_the_center_survives_a_checkpoint():
    """A combine rebuilt from its state_dict continues exactly as the one that wrote it; one
    without the center computes another aggregate."""
    g = torch.Generator().manual_seed(7)
    rounds = [[SparsePayload(*(lambda c: (c[0], c[1:]))(_client(g, 0.3))) for _ in range(4)]
              for _ in range(3)]
    weights = [1.0, 2.0, 3.0, 4.0]
    going = Combine("centered_clip", clip_radius=0.7)
    going(rounds[0], weights, [1.0] * 4, SHAPES)
    state = going.state_dict()
    resumed = Combine("centered_clip", clip_radius=0.7)
    resumed.load_state_dict({"center": state["center"].clone()})
    fresh = Combine("centered_clip", clip_radius=0.7)
    for i, payloads in enumerate(rounds[1:]):
        a = going(payloads, weights, [1.0] * 4, SHAPES)
        b = resumed(payloads, weights, [1.0] * 4, SHAPES)
        c = fresh(payloads, weights, [1.0] * 4, SHAPES)
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
        if i == 0:
            assert not torch.equal(a["w"], c["w"])


@pytest.mark.parametrize("k, size", [(6, 2), (7, 2), (7, 3)])
def test_bucketed_centered_clip_clips_the_weighted_means_of_the_drawn_buckets(k, size):
    """Bucketing (ICLR 2022): the clients in the drawn order, cut into buckets of ``size`` (the
    last one smaller), each the weighted mean of its clients with their weights' sum; centered
    clipping then runs on the buckets, as its dense definition does on their rows."""
    g = torch.Generator().manual_seed(k + size)
    clients = [_client(g, 0.4) for _ in range(k)]
    weights = [float(w) for w in torch.randint(1, 50, (k,), generator=g)]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(5 * 1_000_003)).tolist()
    groups = [order[i:i + size] for i in range(0, k, size)]
    rows = torch.stack([sum(weights[i] * _dense(clients[i]) for i in grp)
                        / sum(weights[i] for i in grp) for grp in groups])
    bucket_weights = [sum(weights[i] for i in grp) for grp in groups]
    got_entries, got_weights = buckets(_entries(clients), weights, size,
                                       torch.Generator().manual_seed(5 * 1_000_003))
    assert got_weights == bucket_weights
    dense = torch.stack([torch.zeros(SIZE, dtype=torch.float64).index_add_(0, i, v)
                         for i, v in got_entries])
    torch.testing.assert_close(dense, rows, rtol=0, atol=1e-12)
    cc = CenteredClip(1.0, 3, bucket_size=size, seed=5)
    got = cc(_entries(clients), weights, SIZE)
    want = _centered_clip_dense(rows, bucket_weights, torch.zeros(SIZE, dtype=torch.float64),
                                1.0, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    # A client alone in its bucket is clipped as without bucketing.
    alone = CenteredClip(1.0, 3)(_entries(clients), weights, SIZE)
    assert not torch.allclose(got, alone)


def test_the_bucket_draws_survive_a_checkpoint_and_old_checkpoints_resume():
    """A resumed bucketed combine draws the orders the uninterrupted one draws (the count of
    rounds drawn is in its state); a state of before bucketing (no count) starts it at 0."""
    g = torch.Generator().manual_seed(9)
    rounds = [[SparsePayload(*(lambda c: (c[0], c[1:]))(_client(g, 0.5))) for _ in range(6)]
              for _ in range(3)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    going = Combine("centered_clip", bucket_size=2, seed=2)
    going(rounds[0], weights, [1.0] * 6, SHAPES)
    state = going.state_dict()
    assert state["draws"] == 1
    resumed = Combine("centered_clip", bucket_size=2, seed=2)
    resumed.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    redrawn = Combine("centered_clip", bucket_size=2, seed=2)  # the center, not the count
    redrawn.load_state_dict({"center": state["center"].clone()})
    assert redrawn.centered.draws == 0
    a = going(rounds[1], weights, [1.0] * 6, SHAPES)
    b = resumed(rounds[1], weights, [1.0] * 6, SHAPES)
    c = redrawn(rounds[1], weights, [1.0] * 6, SHAPES)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert not torch.equal(a["w"], c["w"])  # another draw: other pairs (seed 2: 03 14 25, 05 12 34)


def test_the_gates_trend_is_a_moving_average_kept_in_the_checkpoint():
    """gate_reference = trend: the first aggregate, then 0.9 of the trend and 0.1 of each new
    aggregate; a combine rebuilt from its state continues it, one from a state without a trend
    (of before the key) starts it again from its next aggregate."""
    g = torch.Generator().manual_seed(11)
    rounds = [[SparsePayload(*(lambda c: (c[0], c[1:]))(_client(g, 0.5))) for _ in range(5)]
              for _ in range(3)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]

    def flat(out: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([out[n].reshape(-1).double() for n in SHAPES])

    going = Combine("centered_clip", min_cosine=-0.5, gate_reference="trend")
    first = flat(going(rounds[0], weights, [1.0] * 5, SHAPES))
    torch.testing.assert_close(going.trend, first)
    state = going.state_dict()
    resumed = Combine("centered_clip", min_cosine=-0.5, gate_reference="trend")
    resumed.load_state_dict({k: v.clone() for k, v in state.items() if k != "draws"})
    old = Combine("centered_clip", min_cosine=-0.5, gate_reference="trend")
    old.load_state_dict({"center": state["center"].clone()})
    second = flat(going(rounds[1], weights, [1.0] * 5, SHAPES))
    torch.testing.assert_close(going.trend, 0.9 * first + 0.1 * second, rtol=0, atol=1e-12)
    assert torch.equal(flat(resumed(rounds[1], weights, [1.0] * 5, SHAPES)), second)
    assert torch.equal(resumed.trend, going.trend)
    old(rounds[1], weights, [1.0] * 5, SHAPES)
    assert not torch.equal(old.trend, going.trend)


def test_robust_fills_the_aggregation_keys_left_empty():
    plain = RunConfig.from_flat({})
    assert plain.server.robust == "auto"
    s = plain.server
    assert (s.aggregation, s.max_weight_ratio, s.max_norm_ratio) == ("mean", 0.0, 0.0)
    on = plain.with_overrides({"robust": "on"})
    profile = ROBUST_PROFILES["on"]
    assert {k: getattr(on.server, k) for k in profile} == profile
    mine = RunConfig.from_flat({"robust": "on", "aggregation": "median", "max_norm_ratio": 3})
    assert (mine.server.aggregation, mine.server.max_norm_ratio) == ("median", 3.0)
    assert mine.server.max_weight_ratio == profile["max_weight_ratio"]
    off = mine.with_overrides({"robust": "off"})  # the user's keys stay, the rest refills
    assert (off.server.aggregation, off.server.max_norm_ratio,
            off.server.max_weight_ratio) == ("median", 3.0, 0.0)


def test_an_attack_defaults_to_just_under_the_bounds_in_force():
    bounded = RunConfig.from_flat({"max_weight_ratio": 4, "max_norm_ratio": 10,
                                   "attack.clients": "0,1"})
    assert (bounded.train.attack_norm_ratio, bounded.train.attack_weight_ratio) == (9.9, 3.96)
    unbounded = RunConfig.from_flat({"attack.clients": "3"})
    assert (unbounded.train.attack_norm_ratio, unbounded.train.attack_weight_ratio) == (
        10.0, 4.0)
    own = RunConfig.from_flat({"max_norm_ratio": 2, "attack.norm_ratio": 50})
    assert own.train.attack_norm_ratio == 50.0
    assert own.with_overrides({"max_norm_ratio": 5}).train.attack_norm_ratio == 50.0
    assert bounded.with_overrides({"max_norm_ratio": 2}).train.attack_norm_ratio == 1.98


@pytest.mark.parametrize("keys, message", [
    ({"attack.clients": "0,10"}, r"attack.clients names client keys \[10\] outside \[0, 10\)"),
    ({"attack.clients": "0,-1"}, r"attack.clients item '-1' is not a client key"),
    ({"attack.clients": "a"}, r"attack.clients item 'a' is not a client key"),
    ({"attack.kind": "flip"}, r"attack.kind = 'flip' is outside the accepted range"),
    ({"attack.norm_ratio": 0}, r"attack.norm_ratio = 0.0 is outside"),
    ({"aggregation": "krum"}, r"aggregation = 'krum' is outside"),
    ({"robust": "yes"}, r"robust = 'yes' is outside"),
    ({"clip_radius": 0}, r"clip_radius = 0.0 is outside"),
    ({"bucket_size": 0}, r"bucket_size = 0 is outside"),
    ({"gate_reference": "median"}, r"gate_reference = 'median' is outside"),
    ({"gate_memory": 1}, r"gate_memory = 1.0 is outside"),
    ({"gate_memory": -0.1}, r"gate_memory = -0.1 is outside"),
    ({"gate_memory_below": 1.5}, r"gate_memory_below = 1.5 is outside"),
    ({"gate_memory_below": -2}, r"gate_memory_below = -2.0 is outside"),
    ({"clip_radius_clean": -1}, r"clip_radius_clean = -1.0 is outside"),
])
def test_bad_robustness_keys_are_named(keys, message):
    with pytest.raises(SettingsError, match=message):
        RunConfig.from_flat({"num_clients": 10, **keys})


def test_a_checkpoint_of_before_the_attack_keys_resumes():
    """A run config written before issue 26 has no attack keys: without hostile clients they
    compute nothing, so a resume is not refused for them; a changed bound still is."""
    current = RunConfig.from_flat({"max_weight_ratio": 4, "max_norm_ratio": 10}).to_flat()
    written = {k: v for k, v in current.items() if not k.startswith("attack.")}
    check_run_config(written, current)
    from server.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"max_norm_ratio = 10.0 \(now 0.0\)"):
        check_run_config(written, RunConfig.from_flat({"max_weight_ratio": 4}).to_flat())
    hostile = {**current, "attack.clients": "1"}
    with pytest.raises(CheckpointError, match="attack.clients"):
        check_run_config(written, hostile)


@pytest.mark.parametrize("robust", ["off", "on"])
def test_a_checkpoint_of_before_the_direction_gate_resumes_without_it(robust):
    """A run config written before min_cosine ran without the gate (-1): it resumes where the
    gate is still off, and a resume that would turn it on is refused, naming the key."""
    from server.checkpoint import CheckpointError

    current = RunConfig.from_flat({"robust": robust}).to_flat()
    written = {k: v for k, v in current.items() if k != "min_cosine"}
    check_run_config(written, {**current, "min_cosine": -1.0})
    with pytest.raises(CheckpointError, match=r"min_cosine = -1.0 \(now 0.0\)"):
        check_run_config(written, {**current, "min_cosine": 0.0})


def test_a_checkpoint_of_before_the_gates_memory_resumes_without_it():
    """A run config written before gate_memory (and gate_memory_below) ran without a record: it
    resumes where the memory is off (robust = off), and robust = on, whose profile turns it on,
    is refused, naming the keys (gate_memory = 0 resumes it)."""
    from server.checkpoint import CheckpointError

    written = {k: v for k, v in RunConfig.from_flat({"robust": "on"}).to_flat().items()
               if k not in ("gate_memory", "gate_memory_below")}
    check_run_config(written, RunConfig.from_flat({"robust": "on", "gate_memory": 0,
                                                   "gate_memory_below": 0}).to_flat())
    on = RunConfig.from_flat({"robust": "on"}).to_flat()
    with pytest.raises(CheckpointError, match=r"gate_memory = 0.0 \(now 0.95\), "
                                              r"gate_memory_below = 0.0 \(now -0.2\)"):
        check_run_config(written, on)
    off = RunConfig.from_flat({"robust": "off"}).to_flat()
    check_run_config({k: v for k, v in off.items() if not k.startswith("gate_memory")}, off)


def test_a_checkpoint_of_robust_on_with_one_radius_is_refused_naming_clip_radius_clean():
    """robust = on gives clip_radius_clean = 2 since issue 35's r35: a robust = on run
    checkpointed before (its config says 0, or lacks the key: one radius in every round) resumes
    only with clip_radius_clean = 0, and robust = on alone is refused, naming the key."""
    from server.checkpoint import CheckpointError

    assert ROBUST_PROFILES["on"]["clip_radius_clean"] == 2.0
    assert ROBUST_PROFILES["off"]["clip_radius_clean"] == 0.0
    before = RunConfig.from_flat({"robust": "on", "clip_radius_clean": 0}).to_flat()
    on = RunConfig.from_flat({"robust": "on"}).to_flat()
    assert before["clip_radius_clean"] == 0.0 and on["clip_radius_clean"] == 2.0
    lacking = {k: v for k, v in before.items() if k != "clip_radius_clean"}
    for written in (before, lacking):
        check_run_config(written, before)
        with pytest.raises(CheckpointError, match=r"clip_radius_clean = 0.0 \(now 2.0\)"):
            check_run_config(written, on)
    off = RunConfig.from_flat({"robust": "off"}).to_flat()
    check_run_config({k: v for k, v in off.items() if k != "clip_radius_clean"}, off)


def test_robust_auto_is_on_for_deployed_clients_and_off_for_simulated_ones(tmp_path):
    """The ServerApp decides by its grid: Flower's deployment grid (the SuperLink's, no
    connection made here) turns it on, fedgc's in-process engine off; ``deploy`` decides before
    it writes the app's config; a user's choice stands."""
    import threading

    from flwr.superlink.grid import HttpGrid

    from client.app import app as client_app
    from server.app import resolve_robust
    from server.local_grid import LocalGrid
    from simulations.deploy.fedgc_run import deploy_run_config
    from simulations.interrupt import StoppableGrid

    config = RunConfig.from_flat({"results_dir": str(tmp_path), "run_name": "r"})
    deployed = resolve_robust(config, HttpGrid(token="not-connected"))
    assert deployed.server.robust == "on"
    assert deployed.server.aggregation == ROBUST_PROFILES["on"]["aggregation"]
    simulated = resolve_robust(config, LocalGrid(client_app, 2))
    assert (simulated.server.robust, simulated.server.aggregation) == ("off", "mean")
    # The command line wraps its grid in its Ctrl-C switch (Flower's simulation grid on the
    # Ray engine): still simulated.
    stoppable = StoppableGrid(LocalGrid(client_app, 2), threading.Event())
    assert resolve_robust(config, stoppable).server.robust == "off"
    assert resolve_robust(config, StoppableGrid(HttpGrid(token="x"), threading.Event())
                          ).server.robust == "on"
    assert deployed.run_dir == simulated.run_dir == config.run_dir
    chosen = config.with_overrides({"robust": "off"})
    assert resolve_robust(chosen, HttpGrid(token="x")).server.aggregation == "mean"
    deploy = deploy_run_config({"results_dir": str(tmp_path), "run_name": "d"}, 3)
    assert (deploy.server.robust, deploy.server.aggregation) == (
        "on", ROBUST_PROFILES["on"]["aggregation"])
    assert deploy_run_config({"results_dir": str(tmp_path), "run_name": "d",
                              "robust": "off"}, 3).server.aggregation == "mean"


def _round_of_ten(seed: int = 3) -> tuple[torch.Tensor, list[float]]:
    """Eight honest dense updates of the test space that share a direction (rows), as honest
    updates do, and their claimed weights (skewed, as a Dirichlet partition's)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(SIZE, generator=g, dtype=torch.float64)
    honest = common + 1.5 * torch.randn(8, SIZE, generator=g, dtype=torch.float64)
    return honest, [60.0, 250.0, 120.0, 90.0, 300.0, 140.0, 75.0, 180.0]


def _payload(row: torch.Tensor) -> SparsePayload:
    offsets, _ = space_offsets(SHAPES)
    dense = {n: row[offsets[n]:offsets[n] + math.prod(s)].view(s).float()
             for n, s in SHAPES.items()}
    return SparsePayload(SparseUpdate.from_dense(dense, "float32", 1), [])


def _deployed(rows: torch.Tensor, weights: list[float], center: torch.Tensor,
              ) -> tuple[torch.Tensor, dict[int, float]]:
    """``robust = on``'s defences and combine (ROBUST_PROFILES) on one round: the aggregate
    (flat float64) and the updates the direction gate left out."""
    from server.defences import Bounds
    from server.replies import CheckedReply

    profile = ROBUST_PROFILES["on"]
    payloads = [_payload(r) for r in rows]
    replies = [CheckedReply(None, i, i + 1, "valid", num_examples=int(w), payload=p)
               for i, (w, p) in enumerate(zip(weights, payloads, strict=True))]
    capped, factors, _ = Bounds(profile["max_weight_ratio"], profile["max_norm_ratio"]).apply(
        replies, replies)
    combine = Combine(profile["aggregation"], min_cosine=profile["min_cosine"])
    combine.centered.center = center.clone()
    out = combine(payloads, capped, factors, SHAPES)
    return torch.cat([out[n].reshape(-1).double() for n in SHAPES]), combine.left_out


def test_the_deployed_default_leaves_out_a_crafted_ipm_update():
    """Two colluders send IPM (Xie et al. 2019) at the largest epsilon min-max's bound allows,
    from full knowledge of the eight honest updates, claiming the honest median weight: plain
    FedAvg's aggregate turns against the honest mean; robust = on leaves both out, and its
    aggregate is what the honest updates alone give it."""
    from client.attacks import ipm

    honest, weights = _round_of_ten()
    crafted = ipm(honest, 0.0)
    claim = statistics.median(weights)
    rows = torch.cat([honest, crafted.expand(2, SIZE)])
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    assert float(crafted @ mean_h) < 0
    all_w = [*weights, claim, claim]
    fedavg = (torch.tensor(all_w, dtype=torch.float64)[:, None] * rows).sum(0) / sum(all_w)
    center = 0.8 * mean_h
    got, left_out = _deployed(rows, all_w, center)
    alone, none_out = _deployed(honest, weights, center)
    assert set(left_out) == {8, 9} and not none_out
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-6)
    assert float(got @ mean_h) > 0.8 * float(mean_h @ mean_h) > float(fedavg @ mean_h)


@pytest.mark.parametrize("reference", ["history", "trend", "round"])
def test_a_gate_judging_by_the_trend_or_the_round_is_not_turned_by_a_hijacked_history(
        reference):
    """Two sign flippers that got in once turned the last aggregate their way (issue 35's
    mnist5k seed 2: the gate then left out four honest clients a round and the model fell to
    10%). Judged by the last aggregate alone, the gate leaves out honest updates and keeps the
    flippers; judged by the trend of the aggregates (which one round moved by a tenth) or by the
    round's own clipped combine, it leaves out the two flippers and keeps every honest
    update."""
    honest, weights = _round_of_ten()
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    rows = torch.cat([honest, (-mean_h).expand(2, SIZE)])
    claim = statistics.median(weights)
    combine = Combine("centered_clip", min_cosine=0.0, gate_reference=reference)
    combine.centered.center = -0.5 * mean_h  # history, turned by the flippers
    combine.trend = 0.9 * mean_h + 0.1 * combine.centered.center  # moved by that one round
    out = combine([_payload(r) for r in rows], [*weights, claim, claim], [1.0] * 10, SHAPES)
    got = torch.cat([out[n].reshape(-1).double() for n in SHAPES])
    if reference != "history":
        assert set(combine.left_out) == {8, 9}
        assert float(got @ mean_h) > 0
    else:
        assert combine.left_out and set(combine.left_out) <= set(range(8))


def _offenders_rounds() -> tuple[list[list[SparsePayload]], list[float]]:
    """Three rounds of ten updates (client keys 0-9): in the first, clients 7, 8 and 9 point
    against the honest direction; in the second, 8 and 9 again (7 is honest again); in the
    third, 8 and 9 send an update along the honest direction (a sign flipper whose negated
    update, late in a run, comes to point with history)."""
    honest, weights = _round_of_ten()
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    against = (-mean_h).expand(2, SIZE)
    first = torch.cat([honest[:7], (-mean_h).expand(3, SIZE)])
    second = torch.cat([honest, against])
    third = torch.cat([honest, (0.5 * mean_h).expand(2, SIZE)])
    claim = statistics.median(weights)
    return ([[_payload(r) for r in rows] for rows in (first, second, third)],
            [*weights, claim, claim])


def _gate_with_memory(memory: float, below: float = 0.0) -> Combine:
    honest, weights = _round_of_ten()
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    combine = Combine("centered_clip", min_cosine=0.0, gate_reference="trend",
                      gate_memory=memory, memory_below=below)
    combine.centered.center, combine.trend = mean_h.clone(), mean_h.clone()
    return combine


@pytest.mark.parametrize("memory", [0.0, 0.95])
def test_a_client_left_out_twice_is_left_out_the_third_time_though_its_cosine_passes(memory):
    """gate_memory: clients 8 and 9, left out in two rounds in a row, are left out in the
    third though their update then points the honest way (held for their record); client 7,
    left out once, is not; without a memory (0) nobody is held."""
    rounds, weights = _offenders_rounds()
    keys = list(range(10))
    combine = _gate_with_memory(memory)
    combine(rounds[0], weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert set(combine.left_out) == {7, 8, 9} and not combine.held_out
    combine(rounds[1], weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert set(combine.left_out) == {8, 9} and not combine.held_out
    combine(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
    if memory:
        assert set(combine.left_out) == combine.held_out == {8, 9}
        assert all(cos >= 0 for cos in combine.left_out.values())
        assert combine.record[8] == pytest.approx(memory * (memory + 1))  # decayed, none new
        assert 7 not in combine.record or combine.record[7] < 1.5
    else:
        assert not combine.left_out and not combine.record
    # Without client keys (a combine under central DP) no record is read or kept.
    before = dict(combine.record)
    combine(rounds[1], weights, [1.0] * 10, SHAPES)
    assert combine.record == before and not combine.held_out


def _near_the_bar_rounds() -> tuple[list[list[SparsePayload]], list[float]]:
    """Three rounds of ten updates: in the first two, clients 8 and 9 send an update just
    below the bar (cosine about -0.1 with the honest direction: an honest outlier's); in the
    third, along the honest direction."""
    honest, weights = _round_of_ten()
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    side = torch.randn(SIZE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    side -= (side @ mean_h) / (mean_h @ mean_h) * mean_h  # orthogonal to the honest direction
    near = (-0.1 * mean_h / mean_h.norm() + side / side.norm()) * mean_h.norm()
    third = torch.cat([honest, (0.5 * mean_h).expand(2, SIZE)])
    rows = torch.cat([honest, near.expand(2, SIZE)])
    claim = statistics.median(weights)
    return ([[_payload(r) for r in x] for x in (rows, rows, third)], [*weights, claim, claim])


@pytest.mark.parametrize("below", [0.0, -0.5])
def test_only_a_left_out_below_gate_memory_below_opens_a_record(below):
    """gate_memory_below: clients 8 and 9, left out twice just below the bar (cosine about
    -0.1), gather a record and are held in the third round at 0 (every left-out counts), but
    open none at -0.5 (not a clear offence) and pass; a flipper's left-outs (cosine -1)
    count at -0.5 as at 0; and once a clear offence (-1) opened a record, a left-out just
    below the bar counts toward it (held the round after)."""
    keys = list(range(10))
    rounds, weights = _near_the_bar_rounds()
    combine = _gate_with_memory(0.95, below)
    for payloads in rounds[:2]:
        combine(payloads, weights, [1.0] * 10, SHAPES, client_keys=keys)
        assert set(combine.left_out) == {8, 9} and not combine.held_out
        assert all(-0.2 < cos < 0 for cos in combine.left_out.values())
    combine(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
    if below < -0.1:
        assert not combine.left_out and not combine.record
    else:
        assert set(combine.left_out) == combine.held_out == {8, 9}
    flipped, weights = _offenders_rounds()
    flips = _gate_with_memory(0.95, below)
    for payloads in flipped:
        flips(payloads, weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert flips.held_out == {8, 9}
    opened = _gate_with_memory(0.95, below)
    for payloads in (flipped[1], rounds[0], rounds[2]):  # -1, then -0.1, then passing
        opened(payloads, weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert opened.held_out == {8, 9}
    assert opened.record[8] == pytest.approx(0.95 * (0.95 + 1))


@pytest.mark.parametrize("first_bar", [None, -0.5])
def test_gate_first_bar_keeps_a_client_without_a_record_in_near_the_bar(first_bar):
    """gate_first_bar: clients 8 and 9 just below min_cosine (cosine about -0.1, an honest
    outlier's), without a record, are left out at min_cosine (None) but kept in at -0.5; a
    flipper (cosine -1) is left out either way and opens its record, and once it is open the
    client is judged at min_cosine again: left out at -0.1 the round after."""
    keys = list(range(10))
    near, weights = _near_the_bar_rounds()
    combine = _gate_with_memory(0.95, -0.5)
    combine.first_bar = first_bar
    combine(near[0], weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert set(combine.left_out) == (set() if first_bar is not None else {8, 9})
    flipped, _ = _offenders_rounds()
    opened = _gate_with_memory(0.95, -0.5)
    opened.first_bar = first_bar
    opened(flipped[1], weights, [1.0] * 10, SHAPES, client_keys=keys)  # cosine -1: opens
    assert set(opened.left_out) == {8, 9} and set(opened.record) == {8, 9}
    opened(near[0], weights, [1.0] * 10, SHAPES, client_keys=keys)  # -0.1, records open
    assert set(opened.left_out) == {8, 9}
    # Without client keys (no record read) the bar is min_cosine's for every client.
    plain = _gate_with_memory(0.95, -0.5)
    plain.first_bar = first_bar
    plain(near[0], weights, [1.0] * 10, SHAPES)
    assert set(plain.left_out) == {8, 9}
    with pytest.raises(ValueError, match="gate_first_bar must be in"):
        Combine("centered_clip", min_cosine=0.0, first_bar=-1.5)


def test_the_gates_record_is_kept_in_the_checkpoint_and_an_old_one_starts_it_afresh():
    """The record resumes from the combine's state (through the checkpoint's weights-only
    load): the resumed third round holds the same clients out and gives the same aggregate,
    bit for bit; a state of before gate_memory (no record) starts the record afresh, so
    nobody is held."""
    import io

    rounds, weights = _offenders_rounds()
    keys = list(range(10))
    going = _gate_with_memory(0.95)
    for payloads in rounds[:2]:
        going(payloads, weights, [1.0] * 10, SHAPES, client_keys=keys)
    buffer = io.BytesIO()
    torch.save(going.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed, old = _gate_with_memory(0.95), _gate_with_memory(0.95)
    resumed.load_state_dict(state)
    old.load_state_dict({k: v for k, v in state.items() if k != "gate_record"})
    want = going(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
    got = resumed(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert resumed.held_out == going.held_out == {8, 9}
    assert all(torch.equal(want[n], got[n]) for n in SHAPES)
    assert resumed.record == going.record
    old(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
    assert not old.held_out and not old.left_out


def test_a_round_the_gate_found_clean_is_clipped_at_the_clean_radius():
    """clip_radius_clean: a round whose gate left nobody out is clipped at that radius (the
    same aggregate as a combine at that clip_radius); a round with an update left out at
    clip_radius."""
    honest, weights = _round_of_ten()
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    claim = statistics.median(weights)
    clean = [_payload(r) for r in torch.cat([honest, honest[:2]])]
    flipped = [_payload(r) for r in torch.cat([honest, (-mean_h).expand(2, SIZE)])]
    all_w = [*weights, claim, claim]

    def combined(payloads: list[SparsePayload], **keys: float) -> tuple[torch.Tensor, Combine]:
        combine = Combine("centered_clip", min_cosine=0.0, gate_reference="trend", **keys)
        combine.centered.center, combine.trend = 0.5 * mean_h, mean_h.clone()
        out = combine(payloads, all_w, [1.0] * 10, SHAPES)
        return torch.cat([out[n].reshape(-1).double() for n in SHAPES]), combine

    wide, gate = combined(clean, clip_radius=1.0, clean_radius=2.0)
    assert not gate.left_out
    assert torch.equal(wide, combined(clean, clip_radius=2.0)[0])
    assert not torch.equal(wide, combined(clean, clip_radius=1.0)[0])
    narrow, gate = combined(flipped, clip_radius=1.0, clean_radius=2.0)
    assert set(gate.left_out) == {8, 9}
    assert torch.equal(narrow, combined(flipped, clip_radius=1.0)[0])


def test_a_clean_round_with_a_client_whose_record_is_open_keeps_the_narrow_radius():
    """clip_radius_clean with the gate's memory: a round whose gate left nobody out is clipped
    at the clean radius only where no client of the round has an open record (a sign flipper
    whose record decayed under the hold passes the gate late in a run: issue 35, r35), and not
    in round 1, which the gate cannot judge; with the records closed, the same round is clipped
    at the clean radius."""
    rounds, weights = _offenders_rounds()
    keys = list(range(10))

    def combined(record: dict[int, float], clean_radius: float,
                 clip_radius: float = 1.0) -> tuple[torch.Tensor, Combine]:
        combine = _gate_with_memory(0.95, -0.2)
        combine.centered.radius_ratio = clip_radius
        combine.clean_radius, combine.record = clean_radius, dict(record)
        out = combine(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
        return torch.cat([out[n].reshape(-1).double() for n in SHAPES]), combine

    opened, gate = combined({8: 1.2, 9: 1.2}, 2.0)  # open, below 1.5: not held
    assert not gate.left_out and set(gate.record) == {8, 9}
    assert torch.equal(opened, combined({8: 1.2, 9: 1.2}, 0.0)[0])
    closed, gate = combined({}, 2.0)
    assert not gate.left_out and not gate.record
    assert torch.equal(closed, combined({}, 0.0, clip_radius=2.0)[0])
    assert not torch.equal(closed, opened)

    # Round 1 (no reference: the gate judged nothing) keeps the narrow radius too.
    def first(clean_radius: float, clip_radius: float = 1.0) -> torch.Tensor:
        combine = Combine("centered_clip", clip_radius=clip_radius, min_cosine=0.0,
                          gate_reference="trend", gate_memory=0.95, clean_radius=clean_radius)
        out = combine(rounds[2], weights, [1.0] * 10, SHAPES, client_keys=keys)
        assert not combine.left_out
        return torch.cat([out[n].reshape(-1).double() for n in SHAPES])

    assert torch.equal(first(2.0), first(0.0))
    assert not torch.equal(first(2.0), first(0.0, clip_radius=2.0))


def test_the_deployed_default_bounds_a_crafted_alie_update_whatever_its_size():
    """Two colluders send ALIE (Baruch et al. 2019, mean - z * std of the honest updates), with
    z far beyond the paper's 0.25: it points the honest way, so it is not left out, but its pull
    does not grow with z (centered clipping), where plain FedAvg's grows with it."""
    from client.attacks import alie

    honest, weights = _round_of_ten()
    claim = statistics.median(weights)
    all_w = [*weights, claim, claim]
    mean_h = (torch.tensor(weights, dtype=torch.float64)[:, None] * honest).sum(0) / sum(weights)
    alone, _ = _deployed(honest, weights, 0.8 * mean_h)
    shifts, fedavg_shifts = [], []
    for z in (5.0, 500.0):
        rows = torch.cat([honest, alie(honest, z).expand(2, SIZE)])
        got, left_out = _deployed(rows, all_w, 0.8 * mean_h)
        assert not left_out
        shifts.append(float((got - alone).norm()))
        fedavg = (torch.tensor(all_w, dtype=torch.float64)[:, None] * rows).sum(0) / sum(all_w)
        fedavg_shifts.append(float((fedavg - mean_h).norm()))
    assert shifts[1] < 1.1 * shifts[0] < 0.5 * float(mean_h.norm())
    assert fedavg_shifts[1] > 50 * fedavg_shifts[0]


def test_the_direction_gate_judges_by_history_only():
    """Round 1 has no history: nothing is left out, whatever min_cosine, not even an update
    against every other; from round 2 one pointing against the last round's aggregate is, and
    its weight leaves the mean with it."""
    honest, weights = _round_of_ten()
    rows = torch.cat([honest, -3 * honest.mean(0, keepdim=True)])
    payloads = [_payload(r) for r in rows]
    combine = Combine("mean", min_cosine=0.5)
    combine(payloads, [*weights, 10.0], [1.0] * 9, SHAPES)
    assert combine.left_out == {}
    second = combine(payloads, [*weights, 10.0], [1.0] * 9, SHAPES)
    assert 8 in combine.left_out and combine.left_out[8] < 0
    kept = [i for i in range(9) if i not in combine.left_out]
    w = torch.tensor([[*weights, 10.0][i] for i in kept], dtype=torch.float64)
    expected = (w[:, None] * rows[kept]).sum(0) / w.sum()
    torch.testing.assert_close(torch.cat([second[n].reshape(-1).double() for n in SHAPES]),
                               expected, rtol=1e-5, atol=1e-6)


def test_the_direction_gate_leaves_out_a_minority_at_most():
    """When every update points against history (history turned, as EF-sign's round 2 does),
    the gate leaves out only the farthest minority, lowest cosines first: the round keeps a
    majority and its mean is theirs."""
    honest, weights = _round_of_ten()
    rows, w5 = honest[:5], weights[:5]
    combine = Combine("mean", min_cosine=0.0)
    first = combine([_payload(r) for r in rows], w5, [1.0] * 5, SHAPES)  # history: their mean
    history = torch.cat([first[n].reshape(-1).double() for n in SHAPES])
    flipped = -rows
    out = combine([_payload(r) for r in flipped], w5, [1.0] * 5, SHAPES)
    cos = torch.nn.functional.cosine_similarity(flipped, history[None, :], dim=1)
    assert bool((cos < 0).all())  # every one below min_cosine 0
    lowest = set(torch.argsort(cos)[:2].tolist())
    assert set(combine.left_out) == lowest  # two of five: a minority
    kept = [i for i in range(5) if i not in lowest]
    w = torch.tensor([w5[i] for i in kept], dtype=torch.float64)
    expected = (w[:, None] * flipped[kept]).sum(0) / w.sum()
    torch.testing.assert_close(torch.cat([out[n].reshape(-1).double() for n in SHAPES]),
                               expected, rtol=1e-5, atol=1e-6)


def test_a_secure_deployment_leaves_robust_off_and_a_conflict_is_one_deploy_error():
    from simulations.deploy.errors import DeployError
    from simulations.deploy.fedgc_run import deploy_run_config

    assert deploy_run_config({}, 3).server.aggregation == "centered_clip"
    # Masked updates cannot be robustly combined: robust = auto is off under secure
    # aggregation (privacy.clip bounds each update), so a deployment of it is not refused.
    secure = deploy_run_config({"method": "dgc_sets", "privacy.secagg": True}, 3)
    assert (secure.server.robust, secure.server.aggregation) == ("off", "mean")
    with pytest.raises(DeployError,
                       match="privacy.secagg = true with aggregation, max_weight_ratio set"):
        deploy_run_config({"method": "dgc_sets", "privacy.secagg": True, "robust": "on"}, 3)
