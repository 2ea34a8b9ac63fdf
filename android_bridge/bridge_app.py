"""A Flower ClientApp that serves each train round by handing the task to a phone via the bridge.

The reply is the one ``client.app`` sends (``fedgc.protocol``): an ``update`` ArrayRecord with
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

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import dgc
from android_bridge.bridge import BridgeError, PhoneBridge, PhoneTask
from android_bridge.initial_model import model_digest
from client import app as client_module
from client.state import ClientState
from dgc import SparseUpdate
from dgc.int8_grid import round_initial
from dgc.wire import max_numel_of
from fedgc import methods
from fedgc import protocol as P

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
    held: dict[str, ClientState] = {}  # device -> the model version it was last sent

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        config = client_module.message_config(msg.content, context)
        allowed = client_module.allowed_callables(context)
        s = client_module.settings_from(config, allowed)
        server_round = int(config[P.SERVER_ROUND])  # type: ignore[arg-type]
        version = int(config[P.MODEL_VERSION])  # type: ignore[arg-type]
        ack = int(config.get(P.ACK_SEQUENCE, -1))  # type: ignore[arg-type]
        device = device_for(context, devices)
        record = held.get(device)
        # A first contact is sent a patch on version 0 (clients_build_initial_model, a
        # default): the bridge builds version 0 from the run's seed as a ClientApp does, and
        # hands the phone the patch if its export builds that same version 0 (a phone exported
        # with the run's seed), the dense model it produces if not.
        initial: dict[str, Any] = {}

        def version_0() -> dict[str, Any]:
            initial.update(client_module.initial_model(
                client_module.task_of(s.task_spec(), allowed), s.seed))
            return dict(initial)

        global_state = client_module.global_model(msg.content, config, record,
                                                  initial=version_0)
        patch = base = None
        base_sha256 = ""
        if str(config.get(P.DOWNLINK, "dense")) == "patch":
            bases = [int(v) for v in config.get(P.BASE_VERSIONS,  # type: ignore[union-attr]
                                                [config[P.BASE_VERSION]])]
            if record is not None or 0 in bases:
                patch = P.record_to_bytes(msg.content.array_records[P.ARRAYS], P.PATCH)
                base = int(config[P.BASE_VERSION]) if record is not None else 0
                if config.get(P.PATCH_ADD):
                    patch = _as_values(patch, list(config[P.PATCH_ADD]),  # type: ignore[arg-type]
                                       global_state)
            if record is None and patch is not None:
                start = (round_initial(initial) if bool(config.get(P.INITIAL_GRID, False))
                         else initial)
                base_sha256 = model_digest(start) if start else ""
        held[device] = ClientState(model=global_state, model_version=version)
        method = client_module.method_of(s, config, allowed)
        dgc_config = method.phone_config(s) if method.phone else None
        task = PhoneTask(
            device_id=device, server_round=server_round, model_version=version,
            sequence=server_round, ack_sequence=ack,
            dense_model=dgc.encode(SparseUpdate.from_dense(global_state, "float32", version)),
            config=_phone_config(s, dgc_config), patch=patch,
            base_version=-1 if base is None else base, base_sha256=base_sha256)
        bridge.submit(task)
        result = bridge.wait(task.task_id, timeout_s)
        # The phone encoder has no shared-index channel (dgc.signs): the server aggregates a
        # reply without signs from its top-k update alone. The bridge checked these when the
        # upload began (android_bridge.bridge.parse_metrics): num-examples a whole number >= 1,
        # train_loss finite, restored a whole number >= 0.
        metrics = P.reply_metrics(
            num_examples=int(result.metrics["num-examples"]),
            train_loss=float(result.metrics.get("train_loss", float("nan"))),
            compute_seconds=time.perf_counter() - started,
            restored=int(result.metrics.get("restored", 0)))
        return Message(P.reply_content(result.update_bytes, metrics), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    return app


def _as_values(patch: bytes, added: list[str], model: Mapping[str, Any]) -> bytes:
    """``patch`` with the values of the ``added`` tensors (differences, ``patch_add``) taken
    from ``model``, the model it produces: a patch whose values replace, the only kind phones
    apply."""
    update = dgc.decode(patch, max_numel=max_numel_of(t.shape for t in model.values()))
    tensors = dict(update.tensors)
    for name in added:
        t = tensors[name]
        tensors[name] = dgc.SparseTensor(t.indices, model[name].reshape(-1)[t.indices], t.shape)
    return dgc.encode(SparseUpdate(tensors, update.sequence), grid_coding=True)


def phone_methods() -> list[str]:
    """The registered methods a phone's exported encoder runs (DGC's top-k, with or without its
    residual: :attr:`fedgc.methods.Method.phone`)."""
    return [m.name for m in methods.registered() if m.phone]


def _phone_config(s: Any, dgc_config: dgc.DGCConfig | None) -> dict[str, Any]:
    if dgc_config is None:
        raise BridgeError(f"method {s.method!r} is not served by phones: their encoder is DGC "
                          f"(methods {phone_methods()})")
    # The phone runs exact top-k whatever the server's simulated clients use: the server only
    # decodes what arrives, and exact is what the exported graph implements.
    phone_dgc = dataclasses.replace(dgc_config, selection="exact")
    return {"train": {"lr": s.lr, "batch_size": s.batch_size, "local_steps": s.local_steps,
                      "local_epochs": s.local_epochs, "seed": s.seed, "method": s.method},
            "dgc": phone_dgc.to_dict()}



# -- deployment: `flower-supernode ... --node-config "device-id='phone-a' bridge-address=..."` --

NODE_KEYS = ("bridge-address", "bridge-cert", "bridge-key", "bridge-devices")
_deployed: dict[tuple[str, ...], tuple[PhoneBridge, ClientApp]] = {}


def bridge_from_node_config(node_config: Mapping[str, Any]) -> tuple[PhoneBridge, ClientApp]:
    """The (started) TLS bridge and bridge ClientApp this node's config describes, one per
    distinct config in this process.

    Node config keys: ``bridge-address`` (``host:port`` to listen on), ``bridge-cert`` and
    ``bridge-key`` (PEM files of the server certificate chain and key), ``bridge-devices`` (a
    JSON file ``{"device id": "token", ...}``), optional ``bridge-timeout-s`` (default 600).
    """
    import json

    import grpc

    missing = [k for k in NODE_KEYS if not node_config.get(k)]
    if missing:
        raise BridgeError(f"node config lacks {missing}; the bridge ClientApp needs "
                          f"{list(NODE_KEYS)} (TLS is not optional for phones)")
    ident = tuple(str(node_config[k]) for k in NODE_KEYS)
    if ident not in _deployed:
        address, cert_path, key_path, devices_path = ident
        try:
            with open(cert_path, "rb") as f:
                cert = f.read()
            with open(key_path, "rb") as f:
                key = f.read()
            with open(devices_path) as f:
                devices = json.load(f)
        except (OSError, ValueError) as ex:
            raise BridgeError(f"cannot read the bridge's files: {ex}") from ex
        if not isinstance(devices, dict):
            raise BridgeError(f"{devices_path} must hold a JSON object of device id -> token")
        bridge = PhoneBridge(devices, address, grpc.ssl_server_credentials([(key, cert)]))
        bridge.start()
        timeout_s = float(node_config.get("bridge-timeout-s", 600.0))
        _deployed[ident] = (bridge, make_bridge_app(bridge, timeout_s=timeout_s))
    return _deployed[ident]


#: The ClientApp for deployment (``android_bridge.bridge_app:app``): a supernode whose node config
#: names its phone (``device-id``) and the bridge it serves (:func:`bridge_from_node_config`).
app = ClientApp()


@app.train()
def _train(msg: Message, context: Context) -> Message:
    return bridge_from_node_config(context.node_config)[1](msg, context)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return client_module.app(msg, context)


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return client_module.app(msg, context)
