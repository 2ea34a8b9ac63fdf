"""Hostile clients for robustness studies (issue 26 item 1): what ``attack.*`` makes a client
send, through the real ClientApp and the real wire; and, end to end on digits, that two of ten
clients flipping their update just under the bounds wreck plain FedAvg and not ``robust=on``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

import dgc
from client.app import app as client_app
from client.attacks import Attack
from fedgc import protocol as P
from fedgc.settings import RunConfig
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
