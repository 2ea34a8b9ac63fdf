"""The server's one extension point (server.extensions): keys in the train messages, which
replies arrive, which the round takes, who holds its model; the real ClientApp in process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from flwr.app import Context, Message, MessageType

from client.app import app as client_app
from fedgc import protocol as P
from fedgc.settings import RunConfig
from server.app import run_server
from server.extensions import (
    Added,
    ConfigValue,
    ExtensionError,
    Reply,
    RoundExtension,
    Selection,
)
from server.local_grid import LocalGrid
from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply
from server.strategy import DGCStrategy

BASE = {"task": "digits", "num_clients": 3, "clients_per_round": 3, "partition": "iid",
        "density": 0.05, "progress": False, "local_steps": 2, "rounds": 2,
        "checkpoint": False}


class Recorder(RoundExtension):
    """Tags every train message, loses client 0's replies on the way, and takes the valid
    replies of client 1 only (client 2 trained: it holds the model)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.shown: list[list[int]] = []  # per round, the keys of every reply shown
        self.checked: list[list[int]] = []  # per round, the keys of the checked replies

    def set_model(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)

    def message_keys(self, server_round: int, client_key: int) -> Mapping[str, ConfigValue]:
        return {"test.tag": f"{server_round}:{client_key}"}

    def arrived(self, server_round: int, replies: Sequence[Reply]) -> Sequence[Reply]:
        self.shown.append(sorted(r.client_key for r in replies))
        return [r for r in replies if r.client_key != 0]

    def select(self, server_round: int, checked: Sequence[CheckedReply]) -> Selection:
        self.checked.append(sorted(c.client_key for c in checked))
        return Selection(tuple(c for c in checked if c.client_key == 1), frozenset({2}))

    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        return Added({"taken": sum(r.status == "aggregated" for r in rows)},
                     {r.client_key: {"tagged": 1} for r in rows})


def tagging_client(tags: list[str]):
    """The real ClientApp, noting the tag of each train message it is sent."""

    def call(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            tags.append(str(msg.content.config_records[P.CONFIG]["test.tag"]))
        return client_app(msg, context)

    return call


def test_an_extension_tags_messages_loses_replies_and_selects_what_a_round_takes(tmp_path):
    config = RunConfig.from_flat({**BASE, "results_dir": str(tmp_path), "run_name": "ext",
                                  "over_selection": 1.0})
    tags: list[str] = []
    ext = Recorder()
    made: list[DGCStrategy] = []

    def factory(*args, **kw):
        made.append(DGCStrategy(*args, **kw))
        return made[-1]

    summary = run_server(LocalGrid(tagging_client(tags), 3, seed=1), config,
                         extensions=[ext], strategy_factory=factory)
    strategy = made[0]
    assert ext.shapes == strategy.shapes
    # Every train message carried its round and client (3 sampled a round).
    rows = strategy.client_rows
    assert sorted(tags) == sorted(f"{r.round}:{r.client_key}" for r in rows)
    assert ext.shown == [[0, 1, 2]] * 2  # every reply shown, the lost ones too
    assert ext.checked == [[1, 2]] * 2  # a lost reply is not checked
    status = sorted((r.round, r.client_key, r.status) for r in rows)
    assert status == [(n, k, "aggregated" if k == 1 else "timeout")
                      for n in (1, 2) for k in (0, 1, 2)]
    assert [r.extra["taken"] for r in strategy.rounds] == [1, 1]
    assert all(r.extra["tagged"] == 1 for r in rows)
    assert summary["rounds"] == 2
    # Client 2 was not taken but trained on the model sent: it holds that version; client 0's
    # reply never arrived: it may hold the model sent or what it held before.
    held = strategy.registry.clients
    assert held[2].versions == [1] and held[1].versions == [1] and held[1].acked == 2
    assert held[0].versions != [1]


class Selects(RoundExtension):
    def select(self, server_round: int, checked: Sequence[CheckedReply]) -> Selection:
        return Selection(tuple(checked))


def test_two_extensions_that_select_are_refused_by_name() -> None:
    with pytest.raises(ExtensionError, match=r"\['Selects', 'Recorder'\]"):
        DGCStrategy(RunConfig.from_flat(BASE), extensions=[Selects(), Recorder()])
    DGCStrategy(RunConfig.from_flat(BASE), extensions=[Selects(), RoundExtension()])
