"""A Flower ClientApp that serves each train round by handing the task to a phone via the bridge.

The reply is the one ``client.app`` sends (``client.protocol``): an ``update`` ArrayRecord with
the phone's ``dgc.encode``-d bytes, unchanged, and the ``metrics`` MetricRecord, so the server
cannot tell a phone from a simulated client. The phone keeps its own residual; the server's
``ack_sequence`` travels with the task so that the phone restores an update that was never
aggregated. Evaluate and query messages are answered by ``client.app`` (evaluation runs on the
node, not on the phone: the export has no evaluation program yet).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import dgc
from android_bridge.bridge import BridgeError, PhoneBridge, PhoneTask
from client import app as client_module
from client import protocol as P
from dgc import SparseUpdate

DEVICE_KEY = "device-id"


def device_for(context: Context, devices: Mapping[int, str] | None) -> str:
    """The phone that serves this node: node config ``device-id``, else ``devices[client key]``."""
    if DEVICE_KEY in context.node_config:
        return str(context.node_config[DEVICE_KEY])
    key = client_module.client_key(context)
    if devices is None or key not in devices:
        raise BridgeError(f"node with client key {key} has no phone: set node config "
                          f"{DEVICE_KEY!r} or map the key in devices")
    return devices[key]


def make_bridge_app(bridge: PhoneBridge, devices: Mapping[int, str] | None = None,
                    timeout_s: float = 120.0) -> ClientApp:
    """A ClientApp whose train rounds run on the phones of ``bridge``.

    Parameters
    ----------
    bridge : PhoneBridge
        A started bridge the phones connect to.
    devices : mapping of int to str, optional
        Client key (partition id) -> device id, for nodes without a ``device-id`` node config.
    timeout_s : float
        How long a round waits for the phone's update; past it the ClientApp raises
        :class:`android_bridge.bridge.BridgeTimeout`, which Flower turns into an error reply
        (the server then leaves the update out and the phone restores it next round).
    """
    app = ClientApp()
    held: dict[str, dict[str, Any]] = {}  # device -> the model version it was last sent

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        config = msg.content.config_records.get(P.CONFIG)
        if config is None:
            raise client_module.ClientProtocolError(f"train message has no {P.CONFIG!r} "
                                                    f"ConfigRecord")
        s = client_module.settings_from(config)
        server_round = int(config[P.SERVER_ROUND])  # type: ignore[arg-type]
        version = int(config[P.MODEL_VERSION])  # type: ignore[arg-type]
        ack = int(config.get(P.ACK_SEQUENCE, -1))  # type: ignore[arg-type]
        device = device_for(context, devices)
        key = client_module.client_key(context)
        record = held.get(device)
        global_state = client_module.global_model(msg.content, config, record)
        patch = base = None
        if str(config.get(P.DOWNLINK, "dense")) == "patch":
            patch = P.record_to_bytes(msg.content.array_records[P.ARRAYS], P.PATCH)
            base = int(config[P.BASE_VERSION])  # type: ignore[arg-type]
        held[device] = {"model": global_state, "model_version": version}
        dgc_config = s.dgc_config() if s.method != "dense" else None
        task = PhoneTask(
            device_id=device, server_round=server_round, model_version=version,
            sequence=server_round, ack_sequence=ack,
            dense_model=dgc.encode(SparseUpdate.from_dense(global_state, "float32", version)),
            config=_phone_config(s, dgc_config), patch=patch,
            base_version=-1 if base is None else base)
        bridge.submit(task)
        result = bridge.wait(task.task_id, timeout_s)
        update = result.update
        metrics = MetricRecord({
            "num-examples": int(result.metrics.get("num-examples", 0)),
            "uplink_bytes": len(result.update_bytes),
            "nnz": update.nnz,
            "density": update.density,
            "train_loss": float(result.metrics.get("train_loss", float("nan"))),
            "compute_seconds": time.perf_counter() - started,
            "model_version": version,
            "client_key": key,
            "sequence": server_round,
            "restored": int(result.metrics.get("restored", 0)),
        })
        return Message(RecordDict({P.UPDATE: P.bytes_to_record(result.update_bytes),
                                   P.METRICS: metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    return app


def _phone_config(s: Any, dgc_config: dgc.DGCConfig | None) -> dict[str, Any]:
    if dgc_config is None:
        raise BridgeError("method 'dense' is not served by phones: their encoder is DGC")
    # The phone runs exact top-k whatever the server's simulated clients use: the server only
    # decodes what arrives, and exact is what the exported graph implements.
    phone_dgc = dataclasses.replace(dgc_config, selection="exact")
    return {"train": {"lr": s.lr, "batch_size": s.batch_size, "local_steps": s.local_steps,
                      "local_epochs": s.local_epochs, "seed": s.seed, "method": s.method},
            "dgc": phone_dgc.to_dict()}

