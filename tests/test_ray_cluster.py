"""The simulation on a multi-node Ray cluster: state that follows the client, and what fails.

The slow test starts two Ray nodes on this machine (two ``ray start``s, 1 CPU each, their own
temp and working folders), runs a scenario on them through ``sim.ray_address`` and checks from
``clients.csv`` that clients ran on both nodes and moved between them, and that no gradient mass
was lost across the moves. The others check the failures: an unreachable cluster, a client
whose record is missing or older than the round the server aggregated, a node that does not see
the state folder.
"""

from __future__ import annotations

import csv
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

import client.app as client_app_module
import dgc
from client.state import ClientState, ClientStateStore
from client.stores import StateMissingError, read_state
from fedgc import protocol as P
from fedgc.settings import RunConfig
from server.local_grid import LocalGrid
from simulations.cli import main
from simulations.cluster import check_marker
from simulations.local_cluster import LocalRayCluster, free_port

# ---------------------------------------------------------------- a client whose record is gone


def _settings(tmp_path: Path) -> RunConfig:
    return RunConfig.from_flat({
        "task": "digits", "num_clients": 3, "partition": "iid", "clients_per_round": 3,
        "density": 0.05, "dgc.warmup": "none", "state_dir": str(tmp_path / "state"),
        "results_dir": str(tmp_path), "run_name": "t"})


def _send(grid: LocalGrid, settings: RunConfig, server_round: int, ack: int) -> Message:
    from tasks import get_task

    torch.manual_seed(0)
    arrays = ArrayRecord(get_task("digits").build_model().state_dict())
    node = next(n for n, k in grid.partition_of.items() if k == 1)
    cfg = ConfigRecord({**settings.client_config(), P.SERVER_ROUND: server_round,
                        P.MODEL_VERSION: 0,
                        P.ACK_SEQUENCE: ack, P.DOWNLINK: "dense"})
    msg = Message(RecordDict({P.ARRAYS: arrays, P.CONFIG: cfg}), dst_node_id=node,
                  message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    return reply


def test_a_client_whose_record_is_gone_starts_over_counted(tmp_path, caplog):
    """Issue 26 item 11: it failed every round it was sampled in, for the rest of the run."""
    grid = LocalGrid(client_app_module.app, 3)
    s = _settings(tmp_path)
    assert not _send(grid, s, 1, -1).has_error()
    store = ClientStateStore(s.train.state_dir)
    path = store.root / "1.state"
    path.unlink()  # a lost disk, a reinstalled node, a node that never saw round 1

    with caplog.at_level("WARNING"):
        reply = _send(grid, s, 2, 1)  # the server aggregated round 1
    assert not reply.has_error(), reply.error.reason
    assert reply.content.metric_records[P.METRICS][P.STATE_QUARANTINED] == 1  # counted
    assert "holds no record" in caplog.text and "starts over" in caplog.text
    assert store.get("1")["reply"]["sequence"] == 2
    # It trains on from its new record, as any client.
    reply = _send(grid, s, 3, 2)
    assert not reply.has_error() and P.STATE_QUARANTINED not in reply.content.metric_records[
        P.METRICS]


def test_a_client_with_an_older_record_starts_over_counted(tmp_path):
    grid = LocalGrid(client_app_module.app, 3)
    s = _settings(tmp_path)
    assert not _send(grid, s, 1, -1).has_error()
    path = ClientStateStore(s.train.state_dir).root / "1.state"
    old = path.read_bytes()
    assert not _send(grid, s, 2, -1).has_error()
    path.write_bytes(old)  # the copy of round 1 a node-local folder would still hold

    reply = _send(grid, s, 3, 2)
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content.metric_records[P.METRICS]
    # The older record's pending update is not folded back: the client starts from nothing.
    # (A compact reply names ``restored`` only when it is not 0.)
    assert metrics[P.STATE_QUARANTINED] == 1 and P.RESTORED not in metrics
    assert path.read_bytes() != old


def test_read_state_asks_for_a_record_only_of_dgc_clients_the_server_acked(tmp_path):
    store = ClientStateStore(tmp_path)
    assert read_state(store, "4", -1, True) is None
    assert read_state(store, "4", 3, False) is None  # topk and dense keep no residual
    with pytest.raises(StateMissingError, match="round 3.*holds no record"):
        read_state(store, "4", 3, True, where="Ray node abc")
    store.save("4", ClientState(reply={"sequence": 5}))
    assert read_state(store, "4", 5, True) == ClientState(reply={"sequence": 5})
    with pytest.raises(StateMissingError, match="written in round 5"):
        read_state(store, "4", 6, True)
    # The fresh state that replaced a quarantined record is not a silent loss: it is reported.
    store.save("5", ClientState(quarantined=1))
    assert read_state(store, "5", 3, True) == ClientState(quarantined=1)


# ---------------------------------------------------------------- the cluster cannot be used


def test_an_unreachable_cluster_fails_fast_with_exit_2(tmp_path, capsys):
    port = free_port()  # nothing listens there
    started = time.monotonic()
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", "task=digits",
            "--set", "num_clients=4", "--set", "clients_per_round=2", "--set", "rounds=1",
            "--set", f"sim.ray_address=127.0.0.1:{port}"]
    assert main(argv) == 2
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "no Ray head answers" in err


@pytest.mark.parametrize("sets, words", [
    (["sim.ray_address=headnode"], ["'headnode'", "HOST:PORT"]),
    (["sim.ray_address=ray://head:10001"], ["Ray Client", "HEAD:PORT"]),
    (["sim.ray_address=127.0.0.1:6379", "sim.num_cpus=2"], ["sim.num_cpus = 2", "leave it 0"]),
])
def test_a_bad_cluster_setting_names_itself(tmp_path, capsys, sets, words):
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", "rounds=1"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_the_probe_tells_a_node_local_folder_from_the_shared_one(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    shared.mkdir()
    local.mkdir()
    (shared / ".m").write_text("token")
    assert check_marker(str(shared), ".m", "token", ".m.node") == ""
    assert not (shared / ".m.node").exists()
    assert "FileNotFoundError" in check_marker(str(local), ".m", "token", ".m.node")
    assert "another run" in check_marker(str(shared), ".m", "other", ".m.node")


# ---------------------------------------------------------------- two nodes, one scenario

_recording: dict[str, Any] = {}


def _recording_train_locally(*args: Any, **kwargs: Any) -> Any:
    result = _recording["real"](*args, **kwargs)
    torch.save({k: v.clone() for k, v in result.pseudo_gradient.items()}, _recording["to"])
    return result


recording_app = ClientApp()


@recording_app.train()
def _train(msg: Message, context: Context) -> Message:
    """The real ClientApp, keeping every pseudo-gradient it computes in a shared folder (the
    run's; the test reads it afterwards: the clients run in Ray workers on both nodes)."""
    try:  # the run's keys come whole on first contact, then by their digest
        cfg = client_app_module.message_config(msg.content, context)
    except Exception:  # noqa: BLE001 - the real app answers it (a config it does not hold)
        return client_app_module.app(msg, context)
    out = Path(str(cfg["state_dir"])).parent / "computed"
    out.mkdir(exist_ok=True)
    if "real" not in _recording:
        _recording["real"] = client_app_module.train_locally
        client_app_module.train_locally = _recording_train_locally
    key = client_app_module.client_key(context)
    _recording["to"] = out / f"grad-{key}-{int(cfg[P.SERVER_ROUND])}.pt"
    reply = client_app_module.app(msg, context)
    if not reply.has_error():
        data = P.record_to_bytes(reply.content.array_records[P.UPDATE])
        (out / f"update-{key}-{int(cfg[P.SERVER_ROUND])}.bin").write_bytes(data)
    return reply


@recording_app.query()
def _query(msg: Message, context: Context) -> Message:
    return client_app_module.app(msg, context)


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[LocalRayCluster]:
    """Two Ray nodes on this machine, 1 CPU each; stopped (and checked gone) also on failure."""
    cluster = LocalRayCluster(tmp_path / "cluster", num_nodes=2, cpus_per_node=1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_clients_move_between_two_nodes_and_lose_no_gradient_mass(ray_cluster, tmp_path,
                                                                  monkeypatch, capsys):
    monkeypatch.setattr(client_app_module, "app", recording_app)  # what the runner ships
    results = tmp_path / "results"  # both nodes see it: the shared filesystem
    sets = {"task": "digits", "num_clients": 6, "clients_per_round": 3, "over_selection": 1.5,
            "rounds": 5, "density": 0.05, "dgc.warmup": "none", "dgc.shared_density": 0.0,
            "seed": 4, "results_dir": str(results), "run_name": "two", "checkpoint": False,
            "sim.ray_address": ray_cluster.address,
            # A surplus update folds back whole (issue 37's default decays it): no mass lost.
            "unaggregated": "keep"}
    argv = ["run"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert main(argv) == 0
    assert "2 node(s), 2 CPUs" in capsys.readouterr().out

    run = results / "two"
    with (run / "clients.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 * 5 and {r["status"] for r in rows} <= {"aggregated", "surplus"}
    assert all(len(r["ray_node"]) == 56 for r in rows)  # a Ray node id, hex
    assert len({r["ray_node"] for r in rows}) == 2, "clients ran on both nodes"
    nodes_of = defaultdict(list)
    for r in rows:
        nodes_of[int(r["client_key"])].append(r["ray_node"])
    moved = [k for k, ns in nodes_of.items() if len(set(ns)) > 1]
    assert moved, f"no client changed node between its rounds: {dict(nodes_of)}"

    # Mass: everything a client computed is in the aggregated updates, its residual, or its
    # pending update (when the server did not aggregate it), whichever node ran each round.
    config = RunConfig.from_flat(sets)
    store = ClientStateStore(run / "client_state")
    computed = run / "computed"
    checked = 0
    for key, ns in nodes_of.items():
        mine = [r for r in rows if int(r["client_key"]) == key]
        grads = [torch.load(computed / f"grad-{key}-{r['round']}.pt") for r in mine]
        aggregated = [dgc.decode((computed / f"update-{key}-{r['round']}.bin").read_bytes(),
                                 max_numel=dgc.wire.MAX_NUMEL)
                      for r in mine if r["status"] == "aggregated"]
        acked = max((int(r["round"]) for r in mine if r["status"] == "aggregated"), default=-1)
        record = store.get(str(key))
        c = config.method.compressor(config.train, 0)
        c.load_state_dict(record["compressor"])
        pending = dgc.decode(bytes(record["pending"].numpy().tobytes()),
                             max_numel=dgc.wire.MAX_NUMEL)
        assert pending.sequence == int(mine[-1]["round"])
        for name in grads[0]:
            total = sum(g[name].reshape(-1).double() for g in grads)
            kept = c.residual()[name].double().clone()
            for u in aggregated + ([pending] if pending.sequence != acked else []):
                if name in u.tensors:
                    kept += u.tensors[name].to_dense().reshape(-1).double()
            assert torch.allclose(kept, total, atol=1e-5), (key, name, ns)
        checked += 1
    assert checked == 6
    assert sum(int(r["restored"]) for r in rows) > 0  # surplus updates were folded back



def test_clients_whose_state_is_lost_mid_run_are_back_in_the_next_rounds(tmp_path):
    """Every record deleted after round 1: the clients start over (counted in rounds.csv), a
    round at most fails for those sent a patch on the model they lost, and all are aggregated
    again afterwards (they failed every later round before)."""
    from server.app import run_server

    config = RunConfig.from_flat({
        "task": "digits", "num_clients": 3, "clients_per_round": 3, "rounds": 4,
        "partition": "iid", "progress": False, "sim.engine": "local", "density": 0.05,
        "results_dir": str(tmp_path), "run_name": "lost"})

    def lose_everything(record: Any) -> None:
        if record.round == 1:
            for path in config.state_dir.glob("*.state"):
                path.unlink()

    run_server(LocalGrid(client_app_module.app, 3), config, on_round=lose_everything)
    with (tmp_path / "lost" / "rounds.csv").open() as fh:
        rounds = list(csv.DictReader(fh))
    assert sum(int(r["state_quarantined"]) for r in rounds) == 3
    assert int(rounds[-1]["clients_aggregated"]) == 3 and int(rounds[-2]["clients_aggregated"]) \
        == 3
