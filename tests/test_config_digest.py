"""The run's config goes whole only to a client not known to hold it, its digest otherwise; a
client that lost it (a context Flower made anew) says so and is sent it whole again, with no
crash on either side."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from client.app import app as client_app
from fedgc import protocol as P
from fedgc.settings import RunConfig, TrainSettings, to_flat
from server.app import run_server
from server.local_grid import LocalGrid


def _settings(tmp_path: Path) -> TrainSettings:
    return TrainSettings(task="digits", num_clients=2, partition="iid", clients_per_round=2,
                         state_dir=str(tmp_path / "state"))


def _model() -> ArrayRecord:
    import torch

    from tasks import get_task

    torch.manual_seed(0)
    return ArrayRecord(get_task("digits").build_model().state_dict())


def _send(grid: LocalGrid, s: TrainSettings, server_round: int, whole: bool,
          digest: str | None = None) -> Message:
    run = to_flat(s)
    cfg = ConfigRecord({P.CONFIG_DIGEST: digest or P.config_digest(run),
                        P.SERVER_ROUND: server_round, P.MODEL_VERSION: 0,
                        P.ACK_SEQUENCE: -1, P.DOWNLINK: "dense"})
    content = RecordDict({P.ARRAYS: _model(), P.CONFIG: cfg})
    if whole:
        content[P.RUN_CONFIG] = ConfigRecord(run)
    node = next(n for n, k in grid.partition_of.items() if k == 0)
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=node,
                                              message_type=MessageType.TRAIN)])
    return reply


def test_a_client_reads_later_messages_over_the_config_it_was_sent_whole(tmp_path: Path) -> None:
    grid = LocalGrid(client_app, 2)
    s = _settings(tmp_path)
    # Sent by digest only before it was ever sent whole: the client says what is missing.
    first = _send(grid, s, 1, whole=False)
    assert first.has_error() and P.CONFIG_MISSING in first.error.reason
    assert not _send(grid, s, 1, whole=True).has_error()
    assert not _send(grid, s, 2, whole=False).has_error()
    # Another config by digest alone: not the one it holds.
    other = _send(grid, s, 3, whole=False, digest="0123456789abcdef")
    assert other.has_error() and P.CONFIG_MISSING in other.error.reason
    # A whole config that does not match the digest it comes with is refused.
    forged = _send(grid, s, 3, whole=True, digest="0123456789abcdef")
    assert forged.has_error() and "digest" in forged.error.reason
    # Flower made the context anew: the config is gone, and the client says so.
    for context in grid.contexts.values():
        context.state = RecordDict()
    lost = _send(grid, s, 4, whole=False)
    assert lost.has_error() and P.CONFIG_MISSING in lost.error.reason


def test_the_server_sends_the_config_whole_once_and_again_to_a_client_that_lost_it(
        tmp_path: Path) -> None:
    """Three rounds of two clients: the config goes whole in round 1 only, but client 0's
    context is made anew after round 1: its round 2 fails (CONFIG_MISSING), round 3 gets the
    config whole and trains."""
    sent: list[tuple[int, int, bool]] = []  # (round, client, whole)
    grid: LocalGrid

    def watch(reply: Message) -> Message:
        return reply

    grid = LocalGrid(client_app, 2, seed=1, intercept=watch)
    push = grid.push_messages

    def recording_push(messages):  # noqa: ANN001, ANN202 - the grid's own signature
        messages = list(messages)
        for msg in messages:
            cfg = msg.content.config_records[P.CONFIG]
            key = grid.partition_of[msg.metadata.dst_node_id]
            sent.append((int(cfg.get(P.SERVER_ROUND, 0)), key,
                         P.RUN_CONFIG in msg.content.config_records))
            if int(cfg.get(P.SERVER_ROUND, 0)) == 2 and key == 0:
                node = msg.metadata.dst_node_id
                grid.contexts[node].state = RecordDict()
        return push(messages)

    grid.push_messages = recording_push  # type: ignore[method-assign]
    config = RunConfig.from_flat({
        "task": "digits", "num_clients": 2, "clients_per_round": 1, "rounds": 3,
        "over_selection": 2.0, "partition": "iid", "progress": False, "checkpoint": False,
        "results_dir": str(tmp_path), "run_name": "digest", "state_dir": str(tmp_path / "s")})
    summary = run_server(grid, config)
    train = [(r, k, w) for r, k, w in sent if r > 0]
    assert [w for r, k, w in train if r == 1] == [True, True]
    assert (2, 0, False) in train and (2, 1, False) in train
    assert (3, 0, True) in train and (3, 1, False) in train
    rows = (tmp_path / "digest" / "clients.csv").read_text().splitlines()
    lost = [line for line in rows if line.startswith("2,0,")]
    assert lost and "error" in lost[0] and P.CONFIG_MISSING in lost[0]
    again = [line for line in rows if line.startswith("3,0,")]
    assert again and ("aggregated" in again[0] or "surplus" in again[0])
    assert summary["rounds"] == 3
    assert json.loads((tmp_path / "digest" / "summary.json").read_text())["rounds"] == 3
