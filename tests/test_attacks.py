"""Hostile clients for robustness studies (issue 26 item 1): what ``attack.*`` makes a client
send, through the real ClientApp and the real wire; and, end to end on digits, that two of ten
clients flipping their update just under the bounds wreck plain FedAvg and not ``robust=on``."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

import dgc
from client.app import app as client_app
from client.attacks import Attack, Benign, alie_z, largest_step
from client.collusion import CollusionStore, known_keys
from fedgc import protocol as P
from fedgc.settings import RunConfig, SettingsError
from server.local_grid import LocalGrid
from simulations.api import run

QUICK = {"task": "digits", "num_clients": 10, "clients_per_round": 10, "sim.engine": "local",
         "progress": False, "checkpoint": False}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def test_each_kind_sends_its_attack_at_its_norm_ratio():
    g = torch.Generator().manual_seed(0)
    honest = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    flip = Attack("sign_flip", 3.0, 2.0).update(honest, seed=1)
    assert all(torch.equal(flip[k], -3.0 * honest[k]) for k in honest)
    scaled = Attack("scaled", 2.5, 1.0).update(honest, seed=1)
    assert all(torch.equal(scaled[k], 2.5 * honest[k]) for k in honest)
    noise = Attack("noise", 4.0, 1.0).update(honest, seed=1)
    assert _norm(noise) == pytest.approx(4.0 * _norm(honest), rel=1e-6)
    again = Attack("noise", 4.0, 1.0).update(honest, seed=1)  # seeded
    assert all(torch.equal(noise[k], again[k]) for k in honest)
    assert Attack("sign_flip", 1.0, 3.96).claimed_examples(100) == 396
    assert Attack("sign_flip", 1.0, 1e-6).claimed_examples(100) == 1  # never below 1


def test_a_targeted_attack_trains_towards_its_class():
    y = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(Attack("targeted", 1.0, 1.0, 7).labels(y, 10), torch.full((5,), 7))
    assert Attack("sign_flip", 1.0, 1.0, 7).labels(y, 10) is y
    with pytest.raises(ValueError, match=r"attack.target_class = 10 is not a class of the task: "
                                         r"expected 0 <= target_class < 10"):
        Attack("targeted", 1.0, 1.0, 10).labels(y, 10)


def _reply(settings: RunConfig, tmp: Path) -> tuple[dgc.SparseUpdate, int]:
    """Client 0's round-1 reply under ``settings``: its decoded update and claimed weight."""
    from tasks import get_task

    torch.manual_seed(0)
    model = get_task("digits").build_model()
    grid = LocalGrid(client_app, settings.train.num_clients, seed=0)
    node = next(n for n, k in grid.partition_of.items() if k == 0)
    cfg = ConfigRecord({**settings.client_config(), "state_dir": str(tmp), P.SERVER_ROUND: 1,
                        P.MODEL_VERSION: 0, P.ACK_SEQUENCE: -1, P.DOWNLINK: "dense"})
    msg = Message(RecordDict({P.ARRAYS: ArrayRecord(model.state_dict()), P.CONFIG: cfg}),
                  dst_node_id=node, message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error.reason
    data = P.record_to_bytes(reply.content.array_records[P.UPDATE])
    metrics = reply.content.metric_records[P.METRICS]
    return dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL), int(metrics["num-examples"])


@pytest.mark.parametrize("kind, sign", [("sign_flip", -1.0), ("scaled", 1.0)])
def test_a_hostile_client_replies_its_attack_through_the_client_app(tmp_path, kind, sign):
    """The same client and round, honest and hostile: the hostile reply is its honest update
    times +-9.9 (just under max_norm_ratio 10), claiming 3.96 times its examples (just under
    max_weight_ratio 4); another client of the run stays honest."""
    base = {**QUICK, "method": "dense", "max_weight_ratio": 4, "max_norm_ratio": 10}
    honest, n = _reply(RunConfig.from_flat(base), tmp_path / "a")
    hostile, claimed = _reply(RunConfig.from_flat(
        {**base, "attack.clients": "0", "attack.kind": kind}), tmp_path / "b")
    assert claimed == round(3.96 * n)
    for name, t in honest.to_dense().items():
        torch.testing.assert_close(hostile.to_dense()[name], sign * 9.9 * t, rtol=1e-5,
                                   atol=1e-7)
    other, m = _reply(RunConfig.from_flat({**base, "attack.clients": "5"}), tmp_path / "c")
    assert m == n and all(torch.equal(other.to_dense()[k], v)
                          for k, v in honest.to_dense().items())


def test_a_targeted_class_the_task_lacks_fails_the_round_naming_the_key(tmp_path):
    settings = RunConfig.from_flat({**QUICK, "method": "dense", "attack.clients": "0",
                                    "attack.kind": "targeted", "attack.target_class": 12})
    with pytest.raises(AssertionError, match=r"attack.target_class = 12 is not a class"):
        _reply(settings, tmp_path)


def test_two_hostile_clients_of_ten_wreck_fedavg_and_not_robust_aggregation(tmp_path):
    """digits, 10 clients all in every round, clients 0 and 1 flipping their update 10x
    (plain FedAvg has no bound) and claiming 4x their examples: FedAvg ends near chance;
    robust = on (centered clipping, weights capped at the median) stays within a few points of
    the clean run, FLTrust (a root set of 50 examples) far above chance."""
    keys = {**QUICK, "method": "dense", "rounds": 6, "results_dir": str(tmp_path)}
    attack = {"attack.clients": "0,1", "attack.kind": "sign_flip"}
    clean = run(config={**keys, "run_name": "clean"}).summary["final_accuracy"]
    fedavg = run(config={**keys, **attack, "run_name": "fedavg"}).summary
    robust = run(config={**keys, **attack, "robust": "on", "run_name": "robust"}).summary
    fltrust = run(config={**keys, **attack, "aggregation": "fltrust", "run_name": "fltrust",
                          "root_samples": 50}).summary
    assert fedavg["config"]["aggregation"] == "mean" and fedavg["config"]["robust"] == "off"
    assert robust["config"]["aggregation"] == "centered_clip"
    assert clean > 0.85
    assert fedavg["final_accuracy"] < 0.3
    assert robust["final_accuracy"] > clean - 0.05
    # FLTrust's steps take the root update's size: slower in the first rounds, not wrecked.
    assert fltrust["final_accuracy"] > 0.8


def test_a_centered_clip_run_resumes_bit_for_bit(tmp_path):
    """The center is in the checkpoint: 2 rounds then a resume to 3 give the model of 3
    straight rounds."""
    keys = {**QUICK, "num_clients": 4, "clients_per_round": 4, "local_steps": 2,
            "method": "dense", "aggregation": "centered_clip", "checkpoint": True,
            "results_dir": str(tmp_path)}
    straight = run(config={**keys, "rounds": 3, "run_name": "straight"})
    run(config={**keys, "rounds": 2, "run_name": "resumed"})
    resumed = run(config={**keys, "rounds": 3, "run_name": "resumed", "resume": True})
    a = torch.load(straight.folder / "model.pt")
    b = torch.load(resumed.folder / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------- colluding attacks (issue 35)

def _benign(k: int = 6, seed: int = 0, spread: float = 0.8) -> Benign:
    """``k`` benign updates of a two-tensor model that share a direction, as honest updates do,
    ``spread`` apart, with the numbers of examples their clients claim."""
    g = torch.Generator().manual_seed(seed)
    common = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    updates = [{n: t + spread * torch.randn(t.shape, generator=g) for n, t in common.items()}
               for _ in range(k)]
    return Benign(updates, [100 + 37 * i for i in range(k)])


def _flat(u: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([u["w"].reshape(-1), u["b"]]).double()


def _paper_search(benign: torch.Tensor, dev: torch.Tensor, criterion: str) -> float:
    """Shejwalkar and Houmansadr's own search for gamma (NDSS 2021 code: start at 10, step by
    halves while the bound holds), with a start large enough for these updates."""
    mean = benign.mean(0)
    dist = torch.cdist(benign, benign) ** 2
    bound = dist.max() if criterion == "min_max" else dist.sum(1).min()

    def holds(gamma: float) -> bool:
        d = ((benign - (mean - gamma * dev)) ** 2).sum(1)
        return bool((d.max() if criterion == "min_max" else d.sum()) <= bound)

    gamma, step, ok = 100.0, 100.0, 0.0
    while abs(ok - gamma) > 1e-9:
        if holds(gamma):
            ok, gamma = gamma, gamma + step / 2
        else:
            gamma = gamma - step / 2
        step /= 2
    return ok


def test_alie_sends_the_mean_less_z_standard_deviations():
    """Baruch et al. 2019: n = 10 clients, m = 2 colluders need s = 4 supporters, so
    z = Phi^-1(6/10) = 0.2533; the update is mean - z * std, coordinate-wise."""
    benign = _benign()
    attack = Attack("alie", 1.0, 1.0, round_clients=10, colluders=2)
    sent = attack.update(benign.updates[0], seed=0, benign=benign)
    stacked = benign.stacked()
    expected = stacked.mean(0) - 0.2533471031357997 * stacked.std(0)
    torch.testing.assert_close(_flat(sent), expected.float().double(), rtol=1e-6, atol=1e-6)
    assert sent["w"].shape == (4, 3) and sent["w"].dtype == torch.float32
    assert alie_z(10, 2) == pytest.approx(0.2533471031357997)
    assert alie_z(50, 12) == pytest.approx(statistics.NormalDist().inv_cdf(36 / 50))
    with pytest.raises(ValueError, match=r"ALIE needs 1 <= colluders < round_clients/2 \+ 1, "
                                         r"got 6 colluders of 10"):
        alie_z(10, 6)


def test_ipm_sends_minus_epsilon_times_the_benign_mean():
    """Xie et al. 2019: -epsilon * mean; epsilon 0: the largest min-max's bound allows (none,
    a zero update, where the benign updates are too close for any)."""
    benign = _benign(spread=2.0)
    mean = benign.stacked().mean(0)
    sent = Attack("ipm", 1.0, 1.0, epsilon=0.5).update(benign.updates[0], 0, benign)
    torch.testing.assert_close(_flat(sent), (-0.5 * mean).float().double())
    auto = _flat(Attack("ipm", 1.0, 1.0).update(benign.updates[0], 0, benign))
    epsilon = -float(auto @ mean) / float(mean @ mean)
    assert epsilon == pytest.approx(_paper_search(benign.stacked(), mean, "min_max") - 1,
                                    rel=1e-6)
    assert epsilon > 0.5  # these updates leave it room
    close = _benign(spread=0.1)
    assert not _flat(Attack("ipm", 1.0, 1.0).update(close.updates[0], 0, close)).any()


@pytest.mark.parametrize("deviation", ["std", "unit_vec", "sign"])
@pytest.mark.parametrize("criterion", ["min_max", "min_sum"])
def test_min_max_and_min_sum_take_the_largest_step_their_bound_allows(criterion, deviation):
    """NDSS 2021: mean - gamma * dev with the largest gamma under the bound, solved exactly:
    the paper's own halving search finds the same gamma; the bound then holds with equality."""
    benign = _benign()
    stacked = benign.stacked()
    mean = stacked.mean(0)
    dev = {"std": stacked.std(0), "unit_vec": mean / mean.norm(), "sign": mean.sign()}[deviation]
    sent = _flat(Attack(criterion, 1.0, 1.0, deviation=deviation).update(
        benign.updates[0], 0, benign))
    gamma = largest_step(stacked, dev, criterion)
    assert gamma == pytest.approx(_paper_search(stacked, dev, criterion), rel=1e-6)
    torch.testing.assert_close(sent, (mean - gamma * dev).float().double())
    dist = torch.cdist(stacked, stacked) ** 2
    to_sent = ((stacked - (mean - gamma * dev)) ** 2).sum(1)
    if criterion == "min_max":
        assert float(to_sent.max()) == pytest.approx(float(dist.max()), rel=1e-9)
    else:
        assert float(to_sent.sum()) == pytest.approx(float(dist.sum(1).min()), rel=1e-9)


def test_colluders_claim_the_benign_median_and_need_the_benign_updates():
    benign = _benign()  # claims 100, 137, ..., 285: median 192.5
    attack = Attack("min_max", 1.0, 0.99)
    assert attack.claimed_examples(40, benign) == round(0.99 * 192.5)
    assert Attack("sign_flip", 1.0, 0.99).claimed_examples(40, benign) == round(0.99 * 40)
    with pytest.raises(ValueError, match=r"attack.kind = min_max crafts its update from the "
                                         r"benign updates, and none were given"):
        attack.update(benign.updates[0], 0)


def test_a_colluding_kinds_weight_defaults_to_the_cap_or_the_median():
    base = {**QUICK, "attack.clients": "0,1", "attack.kind": "ipm"}
    assert RunConfig.from_flat(base).train.attack_weight_ratio == 1.0  # no cap: blend in
    capped = RunConfig.from_flat({**base, "max_weight_ratio": 2})
    assert capped.train.attack_weight_ratio == pytest.approx(1.98)
    flip = RunConfig.from_flat({**base, "attack.kind": "sign_flip"})
    assert flip.train.attack_weight_ratio == 4.0  # unchanged for the other kinds
    with pytest.raises(SettingsError, match=r"attack.kind = alie needs fewer colluders than "
                                            r"half the round"):
        RunConfig.from_flat({**base, "attack.kind": "alie", "clients_per_round": 4,
                             "attack.clients": "0,1,2"})


def test_colluders_learn_the_round_once_and_share_it(tmp_path):
    """The first colluder computes the known updates and writes them (listed in the folder's
    manifest); the next one of the same round reads them; another round computes again."""
    calls = []

    def honest(key: int) -> tuple[dict[str, torch.Tensor], int]:
        calls.append(key)
        return {"w": torch.full((2,), float(key))}, 10 + key

    store = CollusionStore(tmp_path)
    tag = {"round": 3, "version": 2, "model": "ab" * 32}
    first = store.learn(tag, [2, 3, 4], honest)
    again = CollusionStore(tmp_path).learn(tag, [2, 3, 4], honest)
    assert calls == [2, 3, 4]
    assert list(again.examples) == [12, 13, 14]
    assert all(torch.equal(a["w"], b["w"]) for a, b in
               zip(first.updates, again.updates, strict=True))
    store.learn({**tag, "round": 4}, [2, 3, 4], honest)
    assert calls == [2, 3, 4, 2, 3, 4]
    from fedgc.ownership import written
    assert written(tmp_path) == ["collusion.knowledge", "collusion.lock"]
    assert known_keys("partial", {1, 0}, 10) == [0, 1]
    assert known_keys("full", {1, 0}, 5) == [2, 3, 4]


def test_colluders_run_end_to_end_and_the_deployed_default_leaves_ipm_out(tmp_path):
    """digits, 10 clients all in every round, clients 0 and 1 colluding with full knowledge
    (IPM): both claim the benign median (just under the cap, 0.99 of it) and, from round 2
    (round 1's benign mean leaves IPM no room: it sends zeros), the deployed default leaves
    their update out of the round; plain FedAvg aggregates it."""
    import csv

    from tasks import get_task

    keys = {**QUICK, "method": "dense", "rounds": 3, "local_steps": 5,
            "results_dir": str(tmp_path), "attack.clients": "0,1", "attack.kind": "ipm",
            "attack.knowledge": "full"}
    robust = run(config={**keys, "robust": "on", "run_name": "robust"})
    rows = list(csv.DictReader((robust.folder / "clients.csv").open()))
    out = {(int(r["round"]), int(r["client_key"])) for r in rows
           if r["reason"].startswith("left out")}
    assert {(2, 0), (2, 1), (3, 0), (3, 1)} <= out
    assert {k for _, k in out} == {0, 1}
    sizes = [len(p) for p in get_task("digits").partition(10, scheme="dirichlet", alpha=0.5,
                                                           seed=0)]
    claims = {int(r["num_examples"]) for r in rows if int(r["client_key"]) < 2}
    assert claims == {round(0.99 * statistics.median(sizes[2:]))}
    assert robust.summary["defences"]["updates_left_out"] == len(out)
    assert (tmp_path / "robust" / "client_state" / "collusion.knowledge").is_file()
    plain = run(config={**keys, "run_name": "plain"})
    statuses = {r["status"] for r in csv.DictReader((plain.folder / "clients.csv").open())}
    assert statuses == {"aggregated"}
