"""Flower's own SecAgg+ (``SecAggPlusWorkflow`` + ``secaggplus_mod``) on a dense model: the bytes
of every message of one round, measured, not computed.

The denominator of issue 38's target ("100x less uplink on the wire than Flower's SecAgg+ on
dense"): this runs Flower's workflow unchanged against an in-process grid that hands each message
to a ``ClientApp`` with Flower's ``secaggplus_mod`` (the messages serialized to Flower's protobuf
and back, as a SuperLink would), and counts each message's protobuf bytes per stage and way.

    PYTHONPATH=. python bench/flower_secaggplus.py [--clients 20] [--shares 19] [--threshold 10]
        [--json out.json]

(fashion-mnist's CNN, 215,370 parameters in 8 tensors; ``num_shares`` counts the client itself,
so 19 shares is fedgc's k = 18 neighbours of 20 clients, ``threshold`` 10 its t.)

The bytes are each ``Message``'s protobuf (``flwr.common.serde.message_to_proto``: metadata and
content), i.e. Flower's payload of a message; the transport (gRPC framing, HTTP/2, TLS, TCP/IP)
comes on top, as the emulator's profile adds it for fedgc's messages.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import FitIns, serde
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow
from flwr.supercore.task_identity import TaskIdentity

from simulations.netem.protocol import load_protocols, message_objects

#: The emulator's profiles whose uplink on the wire is reported: the default (a phone through
#: fedgc's bridge, what the issue's scenario charges) and a SuperNode over TLS (Flower's own).
WIRE_PROFILES = ("bridge-tls", "supernode-tls")


def cnn_shapes() -> list[tuple[int, ...]]:
    from tasks.models import build_model

    model = build_model("cnn", (1, 28, 28), 10)
    return [tuple(v.shape) for v in model.state_dict().values()]


class _Proxy:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.cid = str(node_id)


class _Strategy(FedAvg):
    """FedAvg that samples the given node ids (no ClientManager needed)."""

    def __init__(self, node_ids: list[int]) -> None:
        super().__init__(fraction_evaluate=0.0)
        self._ids = node_ids

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001
        return [(_Proxy(n), FitIns(parameters, {})) for n in self._ids]


def _objects(msg) -> int:  # noqa: ANN001
    """Flower objects of a message, as the emulator counts them (``message_objects``)."""
    c = msg.content
    arrays = [len(a.data) for rec in c.array_records.values() for a in rec.values()]
    records = len(c.array_records) + len(c.config_records) + len(c.metric_records)
    return message_objects(arrays, records)


class _Grid:
    """send_and_receive through Flower's protobuf, counting bytes per stage and way, and the
    uplink on the wire each emulator profile would charge (requests up to fetch the request, the
    reply pushed up)."""

    def __init__(self, apps: dict[int, ClientApp], contexts: dict[int, Context]) -> None:
        self.apps, self.contexts = apps, contexts
        self.bytes = defaultdict(lambda: [0, 0, 0])  # stage -> [down, up, messages]
        self.profiles = load_protocols()
        self.wire_up = defaultdict(lambda: defaultdict(int))  # profile -> stage -> bytes

    def send_and_receive(self, messages, timeout=None):  # noqa: ANN001
        replies = []
        for msg in messages:
            stage = str(msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
            md = msg.metadata
            proto = serde.message_to_proto(msg)
            down = proto.ByteSize()
            msg_in = serde.message_from_proto(proto)
            out = self.apps[md.dst_node_id](msg_in, self.contexts[md.dst_node_id])
            out_proto = serde.message_to_proto(out)
            up = out_proto.ByteSize()
            rec = self.bytes[stage]
            rec[0] += down
            rec[1] += up
            rec[2] += 1
            for name in WIRE_PROFILES:
                prof = self.profiles[name]
                self.wire_up[name][stage] += (prof.download(down, _objects(msg_in))[0]
                                              + prof.upload(up, _objects(out))[0])
            replies.append(serde.message_from_proto(out_proto))
        return replies


def run(clients: int, shares: int, threshold: int, shapes: list[tuple[int, ...]],
        seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        return _run(clients, shares, threshold, shapes, rng)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _run(clients: int, shares: int, threshold: int, shapes: list[tuple[int, ...]],
         rng: np.random.Generator) -> dict:
    ids = list(range(1, clients + 1))
    sent: list[list[np.ndarray]] = []

    class _Client(NumPyClient):
        def fit(self, parameters, config):  # noqa: ANN001
            out = [p + rng.normal(0, 0.01, p.shape).astype(np.float32) for p in parameters]
            sent.append(out)
            return out, 100, {}

    apps = {n: ClientApp(client_fn=lambda ctx: _Client().to_client(), mods=[secaggplus_mod])
            for n in ids}
    contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(),
                           run_config={}) for n in ids}
    grid = _Grid(apps, contexts)
    init = [np.zeros(s, dtype=np.float32) for s in shapes]
    state = RecordDict()
    state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WKey.CURRENT_ROUND: 1})
    state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord(init)
    base = Context(run_id=1, node_id=0, node_config={}, state=state, run_config={})
    ctx = LegacyContext(base, config=ServerConfig(num_rounds=1), strategy=_Strategy(ids))
    workflow = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold)
    t0 = time.process_time()
    workflow(grid, ctx)
    cpu = time.process_time() - t0
    got = ctx.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
    assert [a.shape for a in got] == [tuple(s) for s in shapes], "workflow did not aggregate"
    # Flower's mean (equal weights) against the clients' float mean: its fixed point's error
    error = max(float(np.abs(g - np.mean([c[i] for c in sent], axis=0)).max())
                for i, g in enumerate(got))
    stages = {k: {"down": v[0], "up": v[1], "messages": v[2]} for k, v in grid.bytes.items()}
    coords = int(sum(np.prod(s) for s in shapes))
    up = sum(v["up"] for v in stages.values())
    masked = stages.get("collect_masked_vectors", {}).get("up", 0)
    return {"clients": clients, "num_shares": shares, "threshold": threshold,
            "coordinates": coords, "tensors": len(shapes), "stages": stages,
            "up_per_client": up / clients, "masked_up_per_client": masked / clients,
            "other_up_per_client": (up - masked) / clients,
            "masked_bytes_per_coordinate": masked / clients / coords,
            "down_per_client": sum(v["down"] for v in stages.values()) / clients,
            "wire_up_per_client": {name: {"total": sum(v.values()) / clients,
                                          **{k: b / clients for k, b in v.items()}}
                                   for name, v in grid.wire_up.items()},
            "max_error_of_mean": error, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--shares", type=int, default=19, help="Flower's num_shares (self included)")
    ap.add_argument("--threshold", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = run(args.clients, args.shares, args.threshold, cnn_shapes())
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
