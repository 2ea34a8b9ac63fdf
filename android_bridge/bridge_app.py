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
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import dgc
from android_bridge.bridge import BridgeError, PhoneBridge, PhoneTask
from android_bridge.control import RemoteBridge
from android_bridge.export import check_phone_privacy, check_phone_run
from android_bridge.initial_model import model_digest
from client import app as client_module
from client.state import ClientState, ClientStateStore
from dgc import SparseUpdate
from dgc.int8_grid import round_initial
from dgc.signs.codec import RANK_MAGIC
from fedgc import context_patch, methods
from fedgc import protocol as P
from fedgc.keys import TrainSettings
from fedgc.methods.dgc import RankRequest
from fedgc.methods.material import material_of
from fedgc.patching import ProtocolError, decode_patch, encode_patch, is_compact

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


def ranked_material(msg: Message, model: Mapping[str, Any], method: methods.Method,
                    version_0: Callable[[], dict[str, Any]]) -> tuple[bytes, bool] | None:
    """For a train message whose round material is a rank request (``dgc.shared_rank =
    displacement``): the sets it stands for, derived from ``model`` (the round's model, which
    the phone trains on) and version 0 as a simulated client derives them
    (:meth:`fedgc.methods.dgc.DGC.hold_material`), as an ``FGCM`` mask, and whether version 0
    is on the int8 grid; None for any other material (or none). BridgeError for a rank request
    the method does not read."""
    data = _shared_mask(msg)
    if data is None or bytes(data[:4]) != RANK_MAGIC:
        return None
    part = material_of(method)
    try:
        material = client_module.round_material(msg.content, dict(model), method)
        if part is None or not isinstance(material[1], RankRequest):
            raise ValueError(f"method {method.name!r} does not rank shared sets")
        sets, _ = part.hold_material(*material, model, version_0)
    except (ValueError, client_module.ClientProtocolError, dgc.StateError) as ex:
        raise BridgeError(f"the round's rank request cannot be served: {ex}") from ex
    return sets, material[1].initial_on_grid


def make_bridge_app(bridge: PhoneBridge | RemoteBridge, devices: Mapping[int, str] | None = None,
                    timeout_s: float = 120.0,
                    held: MutableMapping[str, ClientState] | None = None) -> ClientApp:
    """A ClientApp whose train rounds run on the phones of ``bridge``.

    Parameters
    ----------
    bridge : PhoneBridge or RemoteBridge
        A started bridge the phones connect to, or the control API of one that runs in
        another process (``python -m android_bridge serve``, :mod:`android_bridge.control`).
    devices : mapping of int to str, optional
        Client key (partition id) -> device id, for nodes without a ``device-id`` node config.
    timeout_s : float
        How long a round waits for the phone's update; past it the ClientApp raises
        :class:`android_bridge.bridge.BridgeTimeout`, which Flower turns into an error reply
        (the server then leaves the update out and the phone restores it next round).
    held : mutable mapping of str to ClientState, optional
        Device -> the model version it was last sent (a patch is rebuilt on it); in memory by
        default, a :class:`HeldModels` store where each message runs in a process of its own.
    """
    app = ClientApp()
    held = {} if held is None else held

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
        key = client_module.client_key(context)
        record = held.get(device)
        # A first contact is sent a patch on version 0 (clients_build_initial_model, a
        # default): the bridge builds version 0 from the run's seed as a ClientApp does, and
        # hands the phone the patch if its export builds that same version 0 (a phone exported
        # with the run's seed), the dense model it produces if not.
        initial: dict[str, Any] = {}

        def version_0() -> dict[str, Any]:
            if not initial:  # built once a message: the patch, the sets and the digest share it
                initial.update(client_module.initial_model(
                    client_module.task_of(s.task_spec(), allowed), s.seed))
            return dict(initial)

        def digest_of_version_0(on_grid: bool) -> str:
            return model_digest(_version_0_form(version_0(), on_grid))

        global_state = client_module.global_model(msg.content, config, record,
                                                  initial=version_0)
        method = client_module.method_of(s, config, allowed)
        # Displacement from version 0 ranks the round's sets (a rank request) and a context
        # patch's entries: the phone ranks the model it holds against the version 0 its export
        # builds, named by digest; the bridge keeps the sets to check the phone's answer.
        ranked = ranked_material(msg, global_state, method, version_0)
        segmented = [str(n) for n in config.get(P.PATCH_CONTEXT, [])]  # type: ignore[union-attr]
        grid = bool(config.get(P.INITIAL_GRID, False))
        if ranked is not None and segmented and ranked[1] != grid:
            raise BridgeError(f"the round ranks its sets against version 0 "
                              f"{'on' if ranked[1] else 'off'} the int8 grid and its patch "
                              f"{'on' if grid else 'off'} it: a phone holds one version 0")
        initial_sha256 = (digest_of_version_0(ranked[1] if ranked is not None else grid)
                          if ranked is not None or segmented else "")
        patch = base = None
        base_sha256 = ""
        if str(config.get(P.DOWNLINK, "dense")) == "patch":
            bases = [int(v) for v in config.get(P.BASE_VERSIONS,  # type: ignore[union-attr]
                                                [config[P.BASE_VERSION]])]
            if record is not None or 0 in bases:
                patch = P.record_to_bytes(msg.content.array_records[P.ARRAYS], P.PATCH)
                base = int(config[P.BASE_VERSION]) if record is not None else 0
                if config.get(P.PATCH_ADD):
                    # Differences on ranked segments: placed by the ranking of the base (the
                    # model held, or version 0 on a first contact) against version 0.
                    origin = _version_0_form(version_0(), grid) if segmented else {}
                    orders = _orders(record.model if record is not None else origin,
                                     segmented, origin) if segmented else None
                    patch = _as_values(patch, list(config[P.PATCH_ADD]),  # type: ignore[arg-type]
                                       global_state, orders)
            if record is None and patch is not None:
                base_sha256 = digest_of_version_0(grid) if initial else ""
        held[device] = ClientState(model=global_state, model_version=version)
        s = client_module.for_method(s, method)
        task = PhoneTask(
            device_id=device, server_round=server_round, model_version=version,
            sequence=server_round, ack_sequence=ack,
            dense_model=dgc.encode(SparseUpdate.from_dense(global_state, "float32", version)),
            config=_phone_config(s, method, key), patch=patch,
            base_version=-1 if base is None else base, base_sha256=base_sha256,
            shared_mask=_shared_mask(msg), shared_sets=None if ranked is None else ranked[0],
            initial_sha256=initial_sha256,
            patch_context=segmented if patch is not None else [])
        bridge.submit(task)
        result = bridge.wait(task.task_id, timeout_s)
        # The phone answers the round's shared index sets as a simulated client does: its
        # signs travel beside the update, and the server aggregates them alike. The bridge
        # checked the metrics when the upload began (android_bridge.bridge.parse_metrics):
        # num-examples a whole number >= 1, train_loss finite, restored a whole number >= 0.
        side = result.side_bytes or None
        metrics = P.reply_metrics(
            num_examples=int(result.metrics["num-examples"]),
            train_loss=float(result.metrics.get("train_loss", float("nan"))),
            compute_seconds=time.perf_counter() - started,
            restored=int(result.metrics.get("restored", 0)))
        return Message(P.reply_content(result.update_bytes, metrics, side), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return client_module.app(msg, context)

    return app


def _as_values(patch: bytes, added: list[str], model: Mapping[str, Any],
               orders: Mapping[str, Any] | None = None) -> bytes:
    """``patch`` with the values of the ``added`` tensors (differences, ``patch_add``) taken
    from ``model``, the model it produces: a patch whose values replace, the only kind phones
    apply. ``orders``: per tensor sent as segments of its ranking by displacement
    (``patch_context``), that ranking (:func:`fedgc.context_patch.rank_order` of the base
    against version 0), which places a segment's entries; the segments keep their positions.
    A compact patch (``downlink_compact``) is read and written on the layout of ``model`` and
    those segments (:func:`fedgc.patching.decode_patch`), an update message as one.
    BridgeError (one line) for a patch that does not decode on that layout."""
    shapes = {k: tuple(v.shape) for k, v in model.items()}
    context = sorted(orders or {})
    try:
        update = decode_patch(patch, shapes, context)
    except (dgc.DecodeError, ProtocolError) as ex:
        raise BridgeError(f"the round's patch cannot be rewritten as values for a phone: "
                          f"{ex}") from ex
    tensors = dict(update.tensors)
    for name in added:
        flat = model[name].reshape(-1)
        if orders and name in orders:
            bounds = context_patch.cuts(int(orders[name].numel()))
            for j, lo in enumerate(bounds[:-1]):
                seg = tensors.get(context_patch.segment_name(name, j))
                if seg is not None:
                    at = orders[name][seg.indices.to(torch.int64) + lo]
                    tensors[context_patch.segment_name(name, j)] = dgc.SparseTensor(
                        seg.indices, flat[at], seg.shape)
            continue
        t = tensors[name]
        tensors[name] = dgc.SparseTensor(t.indices, flat[t.indices], t.shape)
    return encode_patch(SparseUpdate(tensors, update.sequence), shapes, context,
                        compact=is_compact(patch))


def _version_0_form(initial: Mapping[str, Any], on_grid: bool) -> Mapping[str, Any]:
    """Version 0 as the server holds it: rounded to the int8 grid when the run broadcasts on it
    (``initial_grid``)."""
    return round_initial(initial) if on_grid else initial


def _orders(base: Mapping[str, Any], context: list[str],
            version_0: Mapping[str, Any]) -> dict[str, Any]:
    """Per ``context`` tensor the ranking of ``base`` (the model the patch applies to) by
    displacement from ``version_0``, as the phone and a simulated client rank it."""
    try:
        return {n: context_patch.rank_order(base[n], version_0[n]) for n in context}
    except (KeyError, context_patch.ContextError) as ex:
        raise BridgeError(f"{P.PATCH_CONTEXT} {context}: {ex!r}") from ex


def _shared_mask(msg: Message) -> bytes | None:
    """The round material of a train message (DGC's shared index sets), None without one."""
    record = msg.content.array_records.get(P.SHARED)
    return None if record is None else P.record_to_bytes(record, P.SHARED_MASK)


def _phone_config(s: TrainSettings, method: methods.Method,
                  client_key: int = 0) -> dict[str, Any]:
    """The task config a phone gets (``FetchTaskReply.config_json``): what a simulated client
    of the same key reads from its train message (docs/android.md), for the run's ``method``
    configured with the message's keys."""
    # A method phones do not run, or a run whose client phones cannot run as a simulated client
    # does (its phone refusals), fails the round here, named, rather than letting the phone
    # train otherwise.
    try:
        check_phone_privacy({"privacy.secagg": s.privacy_secagg})
        part = check_phone_run(method)
    except dgc.ConfigError as ex:
        raise BridgeError(str(ex)) from ex
    small = part.phone_small(s)
    # The phone runs exact top-k whatever the server's simulated clients use: the server only
    # decodes what arrives, and exact is what the exported graph implements.
    phone_dgc = dataclasses.replace(part.phone_config(s), selection="exact")
    out: dict[str, Any] = {
        "train": {"lr": s.lr, "batch_size": s.batch_size, "local_steps": s.local_steps,
                  "local_epochs": s.local_epochs, "seed": s.seed, "method": s.method,
                  # The shuffle is seeded by the run's seed, the round and the client's key
                  # (fedgc.training.round_seed); SGD as fedgc.training.train_locally runs it.
                  "client_key": int(client_key), "momentum": s.client_momentum,
                  "weight_decay": s.weight_decay},
        "dgc": phone_dgc.to_dict()}
    if small is not None:
        out["small"] = {"density": small[0], "numel": small[1]}
    values = part.phone_values()
    if values:  # grids the phone rounds to on the host (dgc.shared_values, dgc.value_levels)
        out["values"] = values
    codec = part.phone_task(s, client_key)
    if codec:  # an encoder of the method's own on the phone's host (randk, efsign, signvote)
        out["codec"] = codec
    return out



# -- deployment: `python -m android_bridge serve` and one SuperNode per phone ------------------
#
# Flower 1.42 runs each message in a ClientApp process of its own (started by the SuperNode's
# SuperExec, gone after the reply): the bridge, its phones' sessions and uploads live in the
# serving process instead, and this app reaches it through the control socket. What the bridge
# app must remember between rounds (the model version each phone holds) goes to a store.

#: Node config: the serving bridge's control socket (``unix:/path``), its wait per round.
CONTROL_KEY = "bridge-control"
TIMEOUT_KEY = "bridge-timeout-s"
#: Node config: where the bridge app keeps the model version each phone holds.
STATE_KEY = "state-dir"


class HeldModels(MutableMapping[str, ClientState]):
    """Device -> the model version the bridge last sent it, in a :class:`ClientStateStore`
    (one record per device), for ClientApp processes that last one message."""

    def __init__(self, root: str | Path) -> None:
        self.store = ClientStateStore(root)

    def __getitem__(self, device: str) -> ClientState:
        state = self.store.load(device)
        if state is None:
            raise KeyError(device)
        return state

    def __setitem__(self, device: str, state: ClientState) -> None:
        self.store.save(device, ClientState(model=state.model, model_version=state.model_version))

    def __delitem__(self, device: str) -> None:
        self.store.delete(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.keys())

    def __len__(self) -> int:
        return len(self.store.keys())


@lru_cache(maxsize=8)
def _node_app(control: str, state_dir: str, timeout_s: float) -> ClientApp:
    return make_bridge_app(RemoteBridge(control), timeout_s=timeout_s,
                           held=HeldModels(state_dir))


def node_app(node_config: Mapping[str, Any]) -> ClientApp:
    """The bridge app of a phone's SuperNode, from its node config: ``device-id`` (the phone),
    ``bridge-control`` (the serving bridge's control socket), ``state-dir`` (where the model
    each phone holds is kept; default: the control socket's folder) and, optionally,
    ``bridge-timeout-s`` (how long a round waits for the phone, default 600)."""
    control = str(node_config.get(CONTROL_KEY) or "")
    if not control:
        raise BridgeError(f"node config names phone {node_config.get(DEVICE_KEY)!r} but no "
                          f"{CONTROL_KEY!r}: the control socket of `python -m android_bridge "
                          f"serve`, which holds the phones' sessions")
    socket = Path(control.removeprefix("unix:"))
    state_dir = str(node_config.get(STATE_KEY) or socket.parent / "held-models")
    try:
        timeout_s = float(node_config.get(TIMEOUT_KEY, 600.0))
    except (TypeError, ValueError):
        raise BridgeError(f"node config {TIMEOUT_KEY} = {node_config.get(TIMEOUT_KEY)!r}; "
                          f"expected seconds") from None
    if not 0 < timeout_s <= 86_400:
        raise BridgeError(f"node config {TIMEOUT_KEY} = {timeout_s}; expected (0, 86400] s")
    return _node_app(control, state_dir, timeout_s)


#: The ClientApp for deployment (``android_bridge.bridge_app:app``): a SuperNode whose node config
#: names a phone (``device-id``) hands its train rounds to it through the serving bridge
#: (:func:`node_app`); any other node is a ``client.app`` client. So one app serves a federation
#: of phones and SuperNodes.
app = ClientApp()


@app.train()
def _train(msg: Message, context: Context) -> Message:
    if DEVICE_KEY not in context.node_config:
        return client_module.app(msg, context)
    return node_app(context.node_config)(msg, context)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return client_module.app(msg, context)


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return client_module.app(msg, context)
