"""ClientState: records of earlier versions load, unknown ones are refused, damaged ones are
quarantined and the client trains again from the global model (issue 14, item 8)."""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

import dgc
from client.app import app as client_app
from client.state import (
    STATE_VERSION,
    ClientStateStore,
    StateCorruptError,
    StateVersionError,
)
from fedgc import protocol as P
from fedgc.ownership import MANIFEST
from fedgc.settings import RunConfig
from server.app import run_server
from server.local_grid import LocalGrid
from server.strategy import DGCStrategy

FIXTURE = Path(__file__).parent / "fixtures" / "client_state_v1.state"


def _settings(tmp_path: Path, **kw: object) -> RunConfig:
    # The settings the fixture was written with (tests/test_client_app.py's _settings, dgc).
    return RunConfig.from_flat({
        "task": "digits", "num_clients": 3, "partition": "iid", "clients_per_round": 3,
        "density": 0.05, "dgc.warmup": "none", "state_dir": str(tmp_path / "state"),
        "method": "dgc", "results_dir": str(tmp_path), "run_name": "t", **kw})


def _global() -> ArrayRecord:
    from tasks import get_task

    torch.manual_seed(0)
    return ArrayRecord(get_task("digits").build_model().state_dict())


def _send(grid: LocalGrid, key: int, settings: RunConfig, server_round: int,
          ack: int) -> Message:
    node = next(n for n, k in grid.partition_of.items() if k == key)
    cfg = ConfigRecord({**settings.client_config(), P.SERVER_ROUND: server_round,
                        P.MODEL_VERSION: 0,
                        P.ACK_SEQUENCE: ack, P.DOWNLINK: "dense", P.KEEP_MODEL: True})
    msg = Message(RecordDict({P.ARRAYS: _global(), P.CONFIG: cfg}), dst_node_id=node,
                  message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    return reply


def test_a_record_written_before_the_typed_state_loads(tmp_path):
    """tests/fixtures/client_state_v1.state: written by the untyped ClientApp (round 1 of a dgc
    run with the shared sign channel and keep_model)."""
    (tmp_path / "state").mkdir()
    shutil.copy(FIXTURE, tmp_path / "state" / "0.state")
    store = ClientStateStore(tmp_path / "state")
    assert "state_version" not in store.get("0")  # version 1 had no version key
    state = store.load("0")
    assert state.reply == {"num-examples": 480, "uplink_bytes": 2904, "nnz": 1020,
                           "shared_entries": 84, "density": 0.06795469686875416,
                           "train_loss": 1.15516945021227, "model_version": 0, "client_key": 0,
                           "sequence": 1, "restored": 0}
    pending = dgc.decode(state.pending, max_numel=dgc.wire.MAX_NUMEL)
    assert pending.sequence == 1 and pending.nnz == 1020
    assert state.pending_shared is not None and state.pending_mask is not None
    assert state.model_version == 0 and set(state.model) == set(_global())
    assert state.quarantined == 0
    run = _settings(tmp_path)
    compressor = run.method.compressor(run.train, 0)
    compressor.load_state_dict(state.compressor)  # the residual of the same compressor kind
    assert sum(float(v.abs().sum()) for v in compressor.residual().values()) > 0

    # Saved again it is version 2 with the same content.
    store.save("0", state)
    assert store.get("0")["state_version"] == STATE_VERSION == 2
    again = store.load("0")
    assert again.pending == state.pending and again.reply == state.reply
    assert all(torch.equal(again.model[k], state.model[k]) for k in state.model)

    # And the client carries on from it: the unacknowledged round-1 update is folded back.
    reply = _send(LocalGrid(client_app, 3), 0, _settings(tmp_path), 2, -1)
    assert not reply.has_error(), reply.error.reason
    assert reply.content.metric_records[P.METRICS]["restored"] == 1


def test_a_record_of_an_unknown_version_is_refused_and_kept(tmp_path):
    store = ClientStateStore(tmp_path / "state")
    store.put("0", {"state_version": 99, "pending": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(StateVersionError, match=r"client state 0 has client state version 99; "
                                                r"this fedgc reads versions \[1, 2\]"):
        store.load("0")
    reply = _send(LocalGrid(client_app, 3), 0, _settings(tmp_path), 1, -1)
    assert reply.has_error() and "version 99" in reply.error.reason
    assert sorted(p.name for p in (tmp_path / "state").iterdir()
                  if p.name != MANIFEST) == ["0.state"]  # not moved


@pytest.mark.parametrize(("record", "match"), [
    ({"residual": torch.zeros(2)}, r"unknown fields \['residual'\]"),
    ({"state_version": 1, "quarantined": 1}, r"unknown fields \['quarantined'\]"),
    ({"pending": torch.zeros(2)}, "pending must be a uint8 tensor"),
    ({"model_version": "3"}, "model_version must be a int"),
])
def test_a_record_that_is_not_a_client_state_is_named(tmp_path, record, match):
    store = ClientStateStore(tmp_path)
    store.put("5", record)
    with pytest.raises(StateCorruptError, match=match):
        store.load("5")


def _flip(path: Path, at: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_record_is_quarantined_and_the_client_trains_from_the_global_model(
        tmp_path, caplog):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path)
    assert not _send(grid, 0, s, 1, -1).has_error()
    assert not _send(grid, 1, s, 1, -1).has_error()
    state_dir = tmp_path / "state"
    _flip(state_dir / "0.state")
    with caplog.at_level(logging.WARNING, logger="client.app"):
        reply = _send(grid, 0, s, 2, -1)
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content.metric_records[P.METRICS]
    assert metrics[P.STATE_QUARANTINED] == 1
    assert metrics.get(P.RESTORED, 0) == 0  # nothing to fold back: the pending update was lost
    assert "CRC32 mismatch" in caplog.text and "0.state.corrupt-1" in caplog.text
    assert (state_dir / "0.state.corrupt-1").exists()
    store = ClientStateStore(state_dir)
    assert store.keys() == ["0", "1"]  # the quarantined file is no record
    # The next reply carries no quarantine; a second damage gets the next free name.
    later = _send(grid, 0, s, 3, 2)
    assert P.STATE_QUARANTINED not in later.content.metric_records[P.METRICS]
    _flip(state_dir / "0.state")
    assert _send(grid, 0, s, 4, 3).content.metric_records[P.METRICS][P.STATE_QUARANTINED] == 1
    assert (state_dir / "0.state.corrupt-2").exists()
    # The other client's state was not touched.
    assert store.load("1").reply["sequence"] == 1


class _CorruptingStrategy(DGCStrategy):
    """Damages client 0's state file before round 3 and keeps every reply's metrics."""

    def __init__(self, state_dir: Path, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)
        self.state_dir = state_dir
        self.metrics: dict[tuple[int, int], dict] = {}

    def configure_train(self, server_round, arrays, config, grid):
        if server_round == 3:
            _flip(self.state_dir / "0.state")
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for r in replies:
            if not r.has_error():
                m = dict(r.content.metric_records[P.METRICS])
                self.metrics[(server_round, self.registry.key_of(r.metadata.src_node_id))] = m
        return super().aggregate_train(server_round, replies)


def test_a_client_whose_state_was_damaged_between_rounds_is_aggregated_again(tmp_path):
    c = RunConfig.from_flat({"task": "digits", "num_clients": 3, "clients_per_round": 3,
                             "partition": "iid", "density": 0.05, "dgc.warmup_rounds": 0,
                             "progress": False, "local_steps": 2, "rounds": 4,
                             "results_dir": str(tmp_path), "run_name": "q"})
    made: list[_CorruptingStrategy] = []

    def factory(*args, **kw):
        made.append(_CorruptingStrategy(c.state_dir, *args, **kw))
        return made[0]

    run_server(LocalGrid(client_app, 3, seed=1), c, strategy_factory=factory)
    rows = {(int(r["round"]), int(r["client_key"])): r
            for r in csv.DictReader((c.run_dir / "clients.csv").open())}
    assert all(rows[(2, k)]["status"] == "aggregated" for k in range(3))
    # Round 3 sends client 0 a patch on the model it held, which went with the damaged record:
    # that round fails for it (and the server sends the dense model next time) ...
    assert rows[(3, 0)]["status"] == "error" and "holds version None" in rows[(3, 0)]["reason"]
    assert rows[(3, 1)]["status"] == rows[(3, 2)]["status"] == "aggregated"
    # ... and in round 4 it is aggregated again, reporting the quarantine once.
    assert rows[(4, 0)]["status"] == "aggregated" and rows[(4, 0)]["downlink"] == "dense"
    strategy = made[0]
    assert strategy.metrics[(4, 0)][P.STATE_QUARANTINED] == 1
    assert not any(P.STATE_QUARANTINED in m for k, m in strategy.metrics.items() if k != (4, 0))
    assert (c.state_dir / "0.state.corrupt-1").exists()
    # The run's records show it: the client's row of round 4, and the round's sum.
    assert [k for k, r in rows.items() if r["state_quarantined"] != "0"] == [(4, 0)]
    assert rows[(4, 0)]["state_quarantined"] == "1"
    per_round = {int(r["round"]): int(r["state_quarantined"])
                 for r in csv.DictReader((c.run_dir / "rounds.csv").open())}
    assert per_round == {1: 0, 2: 0, 3: 0, 4: 1}
