"""run_server with the real ClientApp in process: resume, acknowledgements, patches, results."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from flwr.app import ArrayRecord

from client.app import app as client_app
from client.state import ClientStateStore
from fedgc import protocol as P
from fedgc.settings import RunConfig
from server.app import RunFolderError, run_server
from server.checkpoint import CheckpointError, load_checkpoint
from server.local_grid import LocalGrid
from server.preflight import PreflightError
from server.results import ROUND_COLUMNS, SUMMARY_KEYS
from server.strategy import DGCStrategy

BASE = {"task": "digits", "num_clients": 6, "clients_per_round": 3, "partition": "iid",
        "density": 0.01, "dgc.warmup_rounds": 1, "progress": False, "local_steps": 3}


def _config(tmp_path, **kw) -> RunConfig:
    return RunConfig.from_flat({**BASE, "results_dir": str(tmp_path), **kw})


def _model(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path):
    whole = _config(tmp_path, run_name="whole", rounds=5)
    run_server(LocalGrid(client_app, 6, seed=1), whole)
    part = _config(tmp_path, run_name="part", rounds=2)
    run_server(LocalGrid(client_app, 6, seed=2), part)
    written = (part.run_dir / "rounds.csv").read_text()
    # A resume that changes what the run computes is refused, naming the key, and changes
    # nothing on disk (issue 14, item 6).
    for key, value in (("seed", 1), ("density", 0.02), ("num_clients", 5), ("lr", 0.2)):
        changed = _config(tmp_path, run_name="part", rounds=5, resume=True, **{key: value})
        with pytest.raises(CheckpointError, match=f"{key} = "):
            run_server(LocalGrid(client_app, 6, seed=3), changed)
        assert (part.run_dir / "rounds.csv").read_text() == written
    # A new process would see new node ids: a grid with another seed stands for it.
    resumed = _config(tmp_path, run_name="part", rounds=5, resume=True)
    summary = run_server(LocalGrid(client_app, 6, seed=3), resumed)
    a, b = _model(whole.run_dir), _model(resumed.run_dir)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = list(csv.DictReader((whole.run_dir / "rounds.csv").open()))
    rows_b = list(csv.DictReader((resumed.run_dir / "rounds.csv").open()))
    assert [r["accuracy"] for r in rows_a] == [r["accuracy"] for r in rows_b]
    assert [r["uplink_bytes"] for r in rows_a] == [r["uplink_bytes"] for r in rows_b]
    assert summary["rounds"] == 5


def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    for extra in ({}, {"checkpoint": False}):
        c = _config(tmp_path, run_name="nothing", rounds=2, resume=True, **extra)
        with pytest.raises(PreflightError, match="resume=true"):
            run_server(LocalGrid(client_app, 6), c)
        assert not c.run_dir.exists()  # refused before any folder was made (issue 35)


def test_run_folder_is_not_clobbered(tmp_path):
    c = _config(tmp_path, run_name="x", rounds=1)
    run_server(LocalGrid(client_app, 6), c)
    before = (c.run_dir / "rounds.csv").read_text()
    with pytest.raises(RunFolderError, match="resume=true"):
        run_server(LocalGrid(client_app, 6), c)
    assert (c.run_dir / "rounds.csv").read_text() == before


def test_results_schema_and_accuracy_rises(tmp_path):
    c = _config(tmp_path, run_name="schema", rounds=6, lr=0.1)
    summary = run_server(LocalGrid(client_app, 6), c)
    rows = list(csv.DictReader((c.run_dir / "rounds.csv").open()))
    assert set(ROUND_COLUMNS) <= set(rows[0]) and len(rows) == 6
    acc = [float(r["accuracy"]) for r in rows]
    assert all(0.0 <= x <= 1.0 for x in acc) and acc[-1] > acc[0]
    on_disk = json.loads((c.run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(on_disk)
    assert on_disk["uplink_bytes"] == sum(int(r["uplink_bytes"]) for r in rows)
    assert summary["uplink_compression"] == pytest.approx(
        on_disk["dense_uplink_bytes"] / on_disk["uplink_bytes"])
    clients = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    assert len(clients) == 6 * 3
    assert sum(int(r["uplink_bytes"]) for r in clients) == summary["uplink_bytes"]


class RecordingStrategy(DGCStrategy):
    """DGCStrategy that keeps a copy of every model version it sent (what clients may hold)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.sent_versions: dict[int, dict[str, torch.Tensor]] = {}
        self.additive_patches = 0  # messages whose patch adds differences (patch_add)

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.additive_patches += sum(P.PATCH_ADD in m.content.config_records[P.CONFIG]
                                     for m in messages)
        self.sent_versions[self.model_version] = {k: v.clone()
                                                  for k, v in self.sent_model.items()}
        return messages


def _run_recording(c: RunConfig, grid: LocalGrid) -> tuple[dict, RecordingStrategy]:
    made = []

    def factory(*args, **kw):
        made.append(RecordingStrategy(*args, **kw))
        return made[0]

    return run_server(grid, c, strategy_factory=factory), made[0]


def _every_client_holds_what_the_server_sent(c: RunConfig, strategy: RecordingStrategy) -> int:
    """Check every stored client model against the version the server sent; return how many
    of them are among the versions the server believes the client may hold."""
    store = ClientStateStore(c.state_dir)
    checked = 0
    for key in store.keys():
        record = store.get(key)
        if "model" not in record:
            continue
        version = int(record["model_version"])
        for name, t in strategy.sent_versions[version].items():
            assert torch.equal(record["model"][name], t), (key, version, name)
        if version in strategy.registry.clients[int(key)].versions:
            checked += 1
    return checked


def test_patches_keep_client_models_bit_identical_to_the_server(tmp_path):
    # All clients every round, so each holds the previous version and gets patches (of the
    # exact model; the first round's dense).
    c = _config(tmp_path, run_name="patch", rounds=4, num_clients=3, clients_per_round=3,
                downlink_density=1, clients_build_initial_model=False,
                **{"density": 0.001, "dgc.warmup": "none"})
    summary, strategy = _run_recording(c, LocalGrid(client_app, 3))
    rows = list(csv.DictReader((c.run_dir / "rounds.csv").open()))
    assert [int(r["patches_sent"]) for r in rows] == [0, 3, 3, 3]
    assert summary["downlink_bytes"] < summary["dense_downlink_bytes"]
    # Every client rebuilt version 3 from patches (the server's final model is version 4).
    assert _every_client_holds_what_the_server_sent(c, strategy) == 3
    assert all(int(r["model_version"]) == 3 for r in
               map(ClientStateStore(c.state_dir).get, ClientStateStore(c.state_dir).keys()))


def _round_and_key(grid: LocalGrid, reply) -> tuple[int, int]:
    """(round, client key) of a reply: the group id Flower copies from the message it answers
    (the round), and the partition of the node that sent it."""
    return int(reply.metadata.group_id), grid.partition_of[reply.metadata.src_node_id]


def test_unacknowledged_update_is_restored_next_round(tmp_path):
    dropped = []
    grid = LocalGrid(client_app, 3)

    def drop_first_reply_of_round_1(reply):
        if reply.metadata.message_type != "train":
            return reply
        server_round, key = _round_and_key(grid, reply)
        if server_round == 1 and not dropped:
            dropped.append(key)
            return None  # as if the uplink failed
        return reply

    grid.intercept = drop_first_reply_of_round_1
    c = _config(tmp_path, run_name="ack", rounds=2, num_clients=3, clients_per_round=3)
    run_server(grid, c)
    rows = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    by = {(int(r["round"]), int(r["client_key"])): r for r in rows}
    lost = dropped[0]
    assert by[(1, lost)]["status"] == "timeout"
    assert by[(2, lost)]["restored"] == "1"
    others = [k for k in range(3) if k != lost]
    assert all(by[(2, k)]["restored"] == "0" for k in others)


def _dropping_even_rounds(lost: list[int], grid: LocalGrid, most: int = 4) -> LocalGrid:
    """``grid``, its replies intercepted: it loses the first ``most`` train replies of even
    rounds (as if their uplink failed), noting each client in ``lost``."""

    def drop_some(reply):
        if reply.metadata.message_type != "train":
            return reply
        server_round, key = _round_and_key(grid, reply)
        if server_round % 2 == 0 and len(lost) < most:
            lost.append(key)
            return None
        return reply

    grid.intercept = drop_some
    return grid


@pytest.mark.parametrize("values, built", [("float16", False), ("int8", False), ("int8", True)])
def test_compressed_broadcast_keeps_client_models_bit_identical(tmp_path, values, built):
    """downlink_density < 1: clients hold the broadcast model bit for bit, even when replies
    are lost (the server then sends patches valid on either version the client may hold), on
    either grid of downlink_values; int8 patches to clients of known version add differences,
    and clients that build version 0 round it to the grid."""
    lost: list[int] = []
    c = _config(tmp_path, run_name="bcast", rounds=6, downlink_history=6,
                downlink_density=0.01, downlink_values=values, clients_build_initial_model=built)
    summary, strategy = _run_recording(c, _dropping_even_rounds(lost, LocalGrid(client_app, 6)))
    assert (strategy.additive_patches > 0) == (values == "int8")
    exact = _config(tmp_path, run_name="exact", rounds=6, downlink_history=6, downlink_density=1,
                    clients_build_initial_model=False)
    exact_summary = run_server(LocalGrid(client_app, 6), exact)
    rows = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    assert lost and all(r["status"] != "error" for r in rows)  # no patch was refused
    assert sum(r["downlink"] == "patch" for r in rows) > 0
    assert _every_client_holds_what_the_server_sent(c, strategy) >= 3
    assert any(len(info.versions) > 1 for info in strategy.registry.clients.values())
    state = load_checkpoint(c.run_dir)
    # The broadcast model lags the global model (what was not sent waits on the server).
    assert any(not torch.equal(state["broadcast"][k], state["model"][k]) for k in state["model"])
    assert summary["downlink_bytes"] < exact_summary["downlink_bytes"]
    assert bool(state["grid_exponents"]) == (values == "int8")
    for k, e in state["grid_exponents"].items():  # what changed sits on the tensor's grid
        start = strategy.sent_versions[0][k]
        moved = state["broadcast"][k][state["broadcast"][k] != start] / 2.0 ** e
        assert moved.numel() and torch.equal(moved, moved.round())


@pytest.mark.parametrize("values", ["float16", "int8", "ternary"])
def test_compressed_broadcast_resumes_exactly(tmp_path, values):
    extra = {"downlink_density": 0.01, "downlink_history": 4, "downlink_values": values}
    whole = _config(tmp_path, run_name="whole", rounds=4, **extra)
    run_server(LocalGrid(client_app, 6, seed=1), whole)
    part = _config(tmp_path, run_name="part", rounds=2, **extra)
    run_server(LocalGrid(client_app, 6, seed=2), part)
    resumed = _config(tmp_path, run_name="part", rounds=4, resume=True, **extra)
    run_server(LocalGrid(client_app, 6, seed=3), resumed)
    a, b = _model(whole.run_dir), _model(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = list(csv.DictReader((whole.run_dir / "rounds.csv").open()))
    rows_b = list(csv.DictReader((resumed.run_dir / "rounds.csv").open()))
    assert [r["downlink_bytes"] for r in rows_a] == [r["downlink_bytes"] for r in rows_b]
    # Switching the broadcast off on resume would leave clients holding the other model.
    switched = _config(tmp_path, run_name="part", rounds=5, resume=True)
    with pytest.raises(Exception, match="downlink_density"):
        run_server(LocalGrid(client_app, 6, seed=4), switched)
    other_grid = _config(tmp_path, run_name="part", rounds=5, resume=True,
                         **{**extra, "downlink_values": "int8" if values == "float16"
                            else "float16"})
    with pytest.raises(Exception, match="downlink_values"):
        run_server(LocalGrid(client_app, 6, seed=4), other_grid)


def test_stc_run_keeps_client_models_on_the_ternary_broadcast(tmp_path):
    """method = stc: clients hold the server's ternary broadcast bit for bit, with replies lost
    (patches on two versions), clients one version behind adding the last step; the server
    keeps in global - broadcast what it did not send; uplink and downlink far below dense."""
    lost: list[int] = []
    c = _config(tmp_path, run_name="stc", rounds=6, method="stc", downlink_history=6,
                clients_build_initial_model=True, downlink_density=0.02)
    summary, strategy = _run_recording(c, _dropping_even_rounds(lost, LocalGrid(client_app, 6)))
    assert strategy.downlink.values == "ternary" and strategy.optimizer.momentum == 0.0
    assert strategy.additive_patches > 0
    rows = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    assert lost and all(r["status"] != "error" for r in rows)
    assert any(r["restored"] == "1" for r in rows)  # a lost update went back to its residual
    assert all(r["downlink"] == "patch" for r in rows)
    assert _every_client_holds_what_the_server_sent(c, strategy) >= 3
    assert any(len(info.versions) > 1 for info in strategy.registry.clients.values())
    state = load_checkpoint(c.run_dir)
    assert all(not torch.equal(state["broadcast"][k], state["model"][k]) for k in state["model"])
    assert summary["uplink_compression"] > 20
    assert summary["downlink_bytes"] < summary["dense_downlink_bytes"] / 20


def test_fedavgm_is_dense_with_dgc_server_momentum(tmp_path):
    """fedavgm: dense updates, its default server_momentum (0.5, DGC's) on the server, the exact
    model broadcast; the same model as dense with server_momentum set to 0.5 by hand."""
    by_hand = _config(tmp_path, run_name="by_hand", rounds=3, method="dense",
                      server_momentum=0.5)
    fedavgm = _config(tmp_path, run_name="fedavgm", rounds=3, method="fedavgm",
                      downlink_density=0.01)
    plain = _config(tmp_path, run_name="plain", rounds=3, method="dense")
    summaries = [run_server(LocalGrid(client_app, 6), c) for c in (by_hand, fedavgm, plain)]
    a, b, p = (_model(c.run_dir) for c in (by_hand, fedavgm, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], p[k]) for k in a)  # the momentum did something
    assert summaries[1]["uplink_compression"] == pytest.approx(1.0)
    assert summaries[1]["downlink_bytes"] == summaries[0]["downlink_bytes"]
    assert load_checkpoint(fedavgm.run_dir)["broadcast"] is None


def test_dense_runs_always_broadcast_the_exact_model(tmp_path):
    plain = _config(tmp_path, run_name="plain", rounds=3, method="dense")
    run_server(LocalGrid(client_app, 6), plain)
    asked = _config(tmp_path, run_name="asked", rounds=3, method="dense", downlink_density=0.01)
    run_server(LocalGrid(client_app, 6), asked)
    a, b = _model(plain.run_dir), _model(asked.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = list(csv.DictReader((plain.run_dir / "rounds.csv").open()))
    rows_b = list(csv.DictReader((asked.run_dir / "rounds.csv").open()))
    for col in ("accuracy", "uplink_bytes", "downlink_bytes"):
        assert [r[col] for r in rows_a] == [r[col] for r in rows_b]
    assert load_checkpoint(asked.run_dir)["broadcast"] is None


def test_clients_that_build_the_initial_model_get_patches_from_the_start(tmp_path):
    """clients_build_initial_model: first contacts get a patch on version 0, which the client
    builds bit for bit as the server did; training is unchanged."""
    plain = _config(tmp_path, run_name="plain", rounds=3)
    run_server(LocalGrid(client_app, 6), plain)
    c = _config(tmp_path, run_name="v0", rounds=3, downlink_history=10,
                clients_build_initial_model=True)
    summary, strategy = _run_recording(c, LocalGrid(client_app, 6))
    rows = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    assert all(r["downlink"] == "patch" and r["status"] != "error" for r in rows)
    first = [r for r in rows if r["round"] == "1"]
    assert all(int(r["downlink_bytes"]) < 200 for r in first)  # an empty patch on version 0
    assert _every_client_holds_what_the_server_sent(c, strategy) == len(
        ClientStateStore(c.state_dir).keys())
    a, b = _model(plain.run_dir), _model(c.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method, momentum, channel", [
    ("dense", 0.0, False), ("fedavgm", 0.5, False), ("topk", 0.0, False), ("stc", 0.0, False),
    ("dgc", 0.5, True)])
def test_only_dgc_runs_get_the_sign_channel_and_each_method_its_server_momentum(
        tmp_path, method, momentum, channel):
    """Each method's own server momentum (0.5 for fedavgm and dgc, 0 for the others), unless
    the run sets one for every method; the sign channel for dgc only."""
    for keys, want in (({}, momentum), ({"server_momentum": 0.2, "server_lr": 1.5}, 0.2)):
        c = _config(tmp_path, method=method, **keys)
        s = DGCStrategy(c)
        s.set_model(ArrayRecord({"w": torch.zeros(40, 40)}))
        assert (s.optimizer.momentum, s.optimizer.learning_rate) == (
            want, keys.get("server_lr", 1.0))
        assert (s.channel is not None) == channel


def test_progress_line_shows_elapsed_eta_virtual_time_and_surplus():
    from server.app import progress_line
    from server.records import RoundRecord
    from simulations.netem.extension import NetemClock

    record = RoundRecord(round=3, accuracy=0.5, loss=1.0, uplink_bytes=1000,
                         dense_uplink_bytes=100_000, clients_sampled=6, clients_aggregated=4,
                         clients_surplus=2, wall_seconds=2.0, extra={"virtual_seconds": 41.5})
    line = progress_line(record, 10, elapsed=90.0, rounds_timed=3,
                         columns=NetemClock.columns, totals=[123.25])
    assert "failed 0 surplus 2" in line
    # The round's virtual seconds, and the run's so far: the report's (cumulative) axis.
    assert "virtual s: round 41.5 total 123.2" in line
    # 30 s per round so far, 7 rounds left: 3:30.
    assert line.endswith("elapsed 1:30 ETA 3:30")
    plain = progress_line(RoundRecord(round=1), 5)
    assert "surplus" not in plain and "virtual" not in plain and "ETA" not in plain
    # A resumed run estimates from its own rounds only.
    resumed = progress_line(RoundRecord(round=9), 10, elapsed=7200.0, rounds_timed=1)
    assert resumed.endswith("elapsed 2:00:00 ETA 2:00:00")


def test_eval_samples_scores_a_seeded_random_subset(tmp_path):
    """eval_samples: the round's accuracy is that of a fixed random subset of the test split,
    not of its first entries; 0 keeps the whole split."""
    from server.app import evaluation_split
    from tasks import get_task

    task = get_task("digits")
    task.test_y = torch.arange(len(task.test_y))  # labels that name their row
    assert evaluation_split(task, 0, 3)[1] is task.test_y
    assert evaluation_split(task, 10_000, 3)[1] is task.test_y
    x, y = evaluation_split(task, 50, 3)
    assert len(y) == 50 and torch.equal(y, evaluation_split(task, 50, 3)[1])
    assert torch.equal(x, task.test_x[y]) and y.unique().numel() == 50
    assert y.max() > 100, "a random subset, not the first rows"
    assert not torch.equal(y, evaluation_split(task, 50, 4)[1])
    summary = run_server(LocalGrid(client_app, 6, seed=1),
                         _config(tmp_path, eval_samples=40, rounds=1))
    model = get_task("digits").build_model()
    model.load_state_dict(_model(tmp_path / summary["config"]["run_name"]))
    digits = get_task("digits")
    keep = evaluation_split(digits, 40, 0)
    assert summary["final_accuracy"] == pytest.approx(digits.evaluate(model, *keep)[1])
