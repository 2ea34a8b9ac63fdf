"""No update lost: the real ClientApp and the emulator's extensions under 30%+ dropouts, mass
conserved.

The federation runs in this process through :class:`InProcessGrid`, a Flower ``Grid`` that hands
each message to the real ClientApp (wrapped by the emulator's mod) with the node's own Context,
so the test can record every pseudo-gradient a client computed and check, per client, that

    sum of pseudo-gradients == sum of aggregated updates + residual + unacknowledged pending

after rounds with deadline drops and uploads cut by outages mid-transfer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

import client.app as client_app_module
import dgc
from client.state import ClientStateStore
from dgc.signs.codec import decode_mask, decode_signs
from fedgc import protocol as P
from fedgc.methods import get
from fedgc.settings import RunConfig, to_flat
from server.strategy import DGCStrategy
from simulations.netem.integration import extensions, for_run, wrap_client_app
from simulations.netem.mod import reply_metrics
from simulations.netem.settings import NetemSettings


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process (one Context per node)."""

    def __init__(self, app, num_nodes: int) -> None:
        self.app = app
        self.contexts = {100 + k: Context(run_id=1, node_id=100 + k,
                                          node_config={"partition-id": k}, state=RecordDict(),
                                          run_config={}) for k in range(num_nodes)}
        self.replies: list[Message] = []
        self.masks: dict[int, bytes] = {}  # round -> the shared index sets sent (dgc.signs)
        self._run = Run.create_empty(1)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("send_and_receive only")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if P.SHARED in msg.content.array_records:
                rnd = int(msg.content.config_records[P.CONFIG][P.SERVER_ROUND])
                self.masks[rnd] = P.record_to_bytes(msg.content.array_records[P.SHARED],
                                                    P.SHARED_MASK)
            reply = self.app(msg, self.contexts[node])
            assert reply.metadata.src_node_id == node  # a reply comes from its destination
            out.append(reply)
        self.replies.extend(out)
        return out


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.mark.parametrize("shared_density", [0.0, 0.05])
def test_no_update_is_lost_under_dropouts_and_mid_transfer_failures(tmp_path, monkeypatch,
                                                                     shared_density) -> None:
    """With ``shared_density`` > 0 the signs of the shared channel count as sent too."""
    torch.set_num_threads(1)
    computed: dict[int, list[dict[str, torch.Tensor]]] = defaultdict(list)
    real_train = client_app_module.train_locally

    def recording_train(*args, **kwargs):
        result = real_train(*args, **kwargs)
        computed[kwargs["seed"]].append({k: v.clone() for k, v in
                                         result.pseudo_gradient.items()})
        return result

    monkeypatch.setattr(client_app_module, "train_locally", recording_train)

    num_clients, rounds = 10, 10
    config = RunConfig.from_flat({
        "task": "digits", "num_clients": num_clients, "clients_per_round": 4, "rounds": rounds,
        "over_selection": 1.5, "density": 0.02, "dgc.warmup": "none", "seed": 1,
        "results_dir": str(tmp_path), "run_name": "mass", "checkpoint": False,
        "downlink": "dense", "local_epochs": 1, "dgc.shared_density": shared_density,
        "server_momentum": 0.0, "downlink_density": 1.0, "downlink_history": 1,
        "clients_build_initial_model": False})
    # Links down a third of the time with outages ending transfers: many uploads are cut.
    netem = for_run(NetemSettings(enabled=True, mix="3g:0.5,edge:0.5", intermittent=0.8,
                                  intermittent_mean_on_s=1.0, intermittent_mean_off_s=0.5,
                                  outage_policy="fail", deadline_s=40.0, seed=2), config)
    grid = InProcessGrid(wrap_client_app(client_app_module.app), num_clients)
    from tasks import get_task

    task = get_task("digits")
    torch.manual_seed(0)
    model = task.build_model()
    strategy = DGCStrategy(config, extensions=extensions(netem, config))
    train_config = ConfigRecord(to_flat(config.client_train_settings()))
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=rounds,
                   train_config=train_config)

    # Which updates were aggregated, per client key.
    aggregated = defaultdict(list)
    sent = {}
    shapes = {k: (v.numel(),) for k, v in model.state_dict().items()}
    numels = {k: v[0] for k, v in shapes.items()}
    for msg in grid.replies:
        if P.UPDATE in msg.content.array_records:
            key = strategy.registry.node_keys[msg.metadata.src_node_id]
            update = dgc.decode(P.record_to_bytes(msg.content.array_records[P.UPDATE]),
                                max_numel=dgc.wire.MAX_NUMEL)
            sent[(key, update.sequence)] = [update]
            if P.SHARED in msg.content.array_records:
                _, masks = decode_mask(grid.masks[update.sequence], numels)
                sent[(key, update.sequence)].append(decode_signs(P.record_to_bytes(
                    msg.content.array_records[P.SHARED], P.SHARED_SIGNS), masks, shapes))
    for row in strategy.client_rows:
        if row.status == "aggregated":
            aggregated[row.client_key].extend(sent[(row.client_key, row.round)])
    signed = sum(len(v) == 2 for v in sent.values())
    assert (signed > 0) == (shared_density > 0)

    rows = strategy.client_rows
    dropped = [r for r in rows if r.status == "dropped"]
    assert len(dropped) >= 0.3 * len(rows)
    mid_upload = [m for m in map(reply_metrics, grid.replies)
                  if m and m["ok"] == 0.0 and m["compute_s"] > 0]
    assert mid_upload, "some uploads must fail after training, mid-transfer"
    assert sum(r.extra["dropped_link"] for r in strategy.rounds) >= 1
    assert {r.reason for r in dropped} <= {"link_down", "unavailable", "deadline", "straggler"}
    for rec in strategy.rounds:  # every sampled client is aggregated or dropped for a reason
        e = rec.extra
        assert rec.clients_aggregated + rec.clients_surplus + e["dropped_deadline"] \
            + e["dropped_link"] + e["dropped_rejected"] == rec.clients_sampled == 6
        assert rec.clients_surplus == sum(r.status == "surplus" for r in rows
                                          if r.round == rec.round)
        # Closed by the deadline at most; then the server's own work (measured in the run).
        assert 0 < e["virtual_seconds"] - e["round_server_s"] <= 40.0 + 1e-9
    # The links' clock: the clients' part of every round (the measured work is not on it).
    clock = sum(r.extra["virtual_seconds"] - r.extra["round_server_s"] for r in strategy.rounds)
    assert strategy.state_dict()["extensions"][0]["virtual_now_s"] == pytest.approx(clock)

    store = ClientStateStore(config.state_dir)
    seed_of = {k: [] for k in range(num_clients)}
    for s, grads in computed.items():
        key = s % 1_000_003  # round_seed = (seed * P + round) * P + key
        seed_of[key].extend(grads)
    checked = 0
    for key in range(num_clients):
        grads = seed_of[key]
        if not grads:
            continue
        record = store.get(str(key))
        c = get(config.train.method).compressor(config.train, 0)
        c.load_state_dict(record["compressor"])
        pending = [dgc.decode(bytes(record["pending"].numpy().tobytes()),
                              max_numel=dgc.wire.MAX_NUMEL)]
        if "pending_shared" in record:
            _, masks = decode_mask(bytes(record["pending_mask"].numpy().tobytes()), numels)
            pending.append(decode_signs(bytes(record["pending_shared"].numpy().tobytes()),
                                        masks, shapes))
        acked = strategy.registry.clients[key].acked
        for name in grads[0]:
            total = sum(g[name].reshape(-1).double() for g in grads)
            kept = c.residual()[name].double().clone()
            for u in aggregated[key]:
                if name in u.tensors:
                    kept += u.tensors[name].to_dense().reshape(-1).double()
            for p in pending:
                if p.sequence != acked and name in p.tensors:
                    kept += p.tensors[name].to_dense().reshape(-1).double()
            assert torch.allclose(kept, total, atol=1e-5), (key, name)
        checked += 1
    assert checked >= 7


def test_each_reply_is_decoded_and_validated_once_per_round(tmp_path, monkeypatch) -> None:
    """The emulator's clock needs the replies validated to close the round; DGCStrategy
    aggregates those results (update and signs) instead of decoding and checking the taken
    replies again."""
    from server.replies import ReplyChecker

    validated: list[int] = []
    decoded: list[int] = []
    real_validate, real_decode_many = ReplyChecker.check, dgc.decode_many

    def counting_validate(self, msg, *args, **kwargs):
        validated.append(id(msg))
        return real_validate(self, msg, *args, **kwargs)

    def counting_decode_many(blobs, **kwargs):
        decoded.append(len(blobs))
        return real_decode_many(blobs, **kwargs)

    monkeypatch.setattr(ReplyChecker, "check", counting_validate)
    monkeypatch.setattr(dgc, "decode_many", counting_decode_many)
    config = RunConfig.from_flat({
        "task": "digits", "num_clients": 6, "clients_per_round": 4, "rounds": 3,
        "over_selection": 1.5, "density": 0.02, "dgc.warmup": "none", "seed": 1,
        "results_dir": str(tmp_path), "run_name": "once", "checkpoint": False,
        "downlink": "dense", "local_epochs": 1, "dgc.shared_density": 0.05,
        "server_momentum": 0.0, "downlink_density": 1.0, "downlink_history": 1,
        "clients_build_initial_model": False})
    netem = for_run(NetemSettings(enabled=True, mix="lte:1.0", seed=2), config)
    grid = InProcessGrid(wrap_client_app(client_app_module.app), 6)
    from tasks import get_task

    torch.manual_seed(0)
    model = get_task("digits").build_model()
    strategy = DGCStrategy(config, extensions=extensions(netem, config))
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=3,
                   train_config=ConfigRecord(to_flat(config.client_train_settings())))
    updates = [m for m in grid.replies if P.UPDATE in m.content.array_records]
    assert len(updates) == 18  # 6 sampled per round, no drops on this link
    assert sorted(validated) == sorted(map(id, updates))  # each once
    assert [n for n in decoded if n] == [6, 6, 6]  # one batch per round, nothing twice
    assert all(r.clients_aggregated == 4 for r in strategy.rounds)
    # Uplink counted with the signs of each reply (they were decoded once, in the batch).
    signs = {id(m): len(P.record_to_bytes(m.content.array_records[P.SHARED], P.SHARED_SIGNS))
             for m in updates if P.SHARED in m.content.array_records}
    assert len(signs) == 12  # rounds 2 and 3 carry index sets
    aggregated = [r for r in strategy.client_rows if r.status == "aggregated" and r.round > 1]
    assert aggregated and all(r.uplink_bytes > min(signs.values()) for r in aggregated)
