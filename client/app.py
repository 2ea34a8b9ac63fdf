"""The Flower ClientApp: local training, on-device DGC encoding, residual state between rounds.

One train message, in order:

1. read the per-node keys from the message's ConfigRecord over the run's config: sent whole on
   first contact (kept in the context's state), else known by its digest
   (:func:`message_config`);
2. load this client's :class:`client.state.ClientState` from the
   :class:`client.state.ClientStateStore` (compressor residual and momentum, the pending update,
   the model version it holds); a damaged record is moved aside and the client starts again
   from the global model, reporting ``state_quarantined`` in its reply;
3. rebuild the global model: dense arrays, or a patch on the held version;
4. load the run's method's compressor with this client's residual; if the previous update was
   not aggregated (the server's ``ack_sequence`` is not its sequence), fold it back into the
   residual with the compressor's ``restore``, as much of it as the method's ``unaggregated``
   keeps (whole, decayed by its age, capped, or none; the age in rounds, in model versions
   when an asynchronous dispatch says ``age_in_versions``); the method may age that residual and
   move the model training starts from (:meth:`fedgc.methods.RoundMaterial.prepare`);
5. train locally and form the pseudo-gradient ``global - local`` (against the model sent; a
   hostile client of a robustness study, ``attack.clients``, replaces it with its attack:
   ``client.attacks``);
6. compress with the run's method's compressor (:class:`fedgc.methods.Method`; none: all of
   it in fp32), encode with its codec;
7. when the message carries the method's round material (DGC's shared index sets,
   :mod:`dgc.signs`), send the part of the residual that answers it too (the signs);
8. store the new state and pending update(s), and reply; under secure aggregation
   (``privacy.secagg``, :mod:`client.secure`) the reply carries the masked vector of the payload
   instead, and the protocol's other stages are ``query.secagg`` messages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import dgc
from client import node, secure
from client.attacks import Attack, Benign, attack_of
from client.collusion import CollusionStore, known_keys, model_digest
from client.state import (
    ClientState,
    ClientStateStore,
    StateCorruptError,
    fold_back_pending,
    update_age,
)
from client.stores import StateMissingError, read_state
from dgc import Compressor, SparseUpdate
from dgc.int8_grid import round_initial
from fedgc import devices, methods
from fedgc import protocol as P
from fedgc.keys import TrainSettings
from fedgc.keys.attack import parse_attack_clients
from fedgc.keys.run import TaskSpec
from fedgc.methods.material import material_of
from fedgc.privacy.linear import client_compressor
from fedgc.refs import (
    ALLOWED_CALLABLES,
    CallableNotAllowedError,
    check_allowed,
    is_ref,
    parse_allowed,
)
from fedgc.schema import SettingsError, fields_of, fill_fallbacks, parse
from fedgc.task_loader import load_task
from fedgc.training import LocalResult, round_seed, train_locally

app = ClientApp()
logger = logging.getLogger(__name__)

_TRAIN_KEYS = {f.metadata["key"] for f in fields_of(TrainSettings)}
#: What a client keeps of its last reply besides the metrics it sent: which round and model
#: version it answered (a re-sent round is answered with the same bytes).
_KEPT_ONLY = ("sequence", "model_version")


class ClientProtocolError(P.ProtocolError):
    """A train message the client cannot act on (missing keys, a patch for a version it lacks)."""


@lru_cache(maxsize=4)
def task_of(spec: TaskSpec, allowed: frozenset[str] | None = None) -> Any:
    """The task of ``spec``, loaded once per process (the bridge app shares it); a
    ``module:callable`` only if ``allowed`` (:func:`allowed_callables`, None: any) holds it."""
    return load_task(spec, allowed)


def allowed_callables(context: Context) -> frozenset[str] | None:
    """The ``key=module:callable`` references (tasks, methods) a run may make this node call:
    those its node config lists in ``allowed-callables`` (comma-separated,
    :func:`fedgc.refs.parse_allowed`), each for its key, so that a train message cannot name
    code the node was not given, nor a task as its method; None (any) when the list holds
    ``*``, and on Flower's simulation engine, whose nodes run the simulating user's own config.
    A bad entry is a :class:`ClientProtocolError` naming it."""
    if node.in_simulation_engine():
        return None
    try:
        return parse_allowed(str(context.node_config.get(ALLOWED_CALLABLES, "")))
    except CallableNotAllowedError as ex:
        raise ClientProtocolError(str(ex)) from None


_models = threading.local()


def _model(task: Any, name: TaskSpec, device: torch.device | None = None) -> torch.nn.Module:
    """This thread's model for the task of ``name`` on ``device`` (default the host), built
    once and reused by every message.

    Each message loads the whole state dict into it, so nothing of the previous client remains
    (train_locally makes a fresh optimizer and clears the gradients). Building a model per
    message spent a few ms on a random initialisation that the load then overwrote.
    """
    cache = _models.__dict__.setdefault("by_task", {})
    device = torch.device("cpu") if device is None else device
    model = cache.get((name, device))
    if model is None:
        model = cache[(name, device)] = task.build_model().to(device)
    return model


@lru_cache(maxsize=8)
def _partitions(task: TaskSpec, allowed: frozenset[str] | None, num_clients: int, scheme: str,
                alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    parts = task_of(task, allowed).partition(num_clients, scheme=scheme, alpha=alpha, seed=seed)
    return tuple(np.asarray(p, dtype=np.int64) for p in parts)


def client_data(s: TrainSettings, key: int,
                allowed: frozenset[str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``key``'s training data: made from its key when the task makes data per client
    (``tasks.Task.client_data``: nothing is held for the clients not sampled), else its
    partition of the task's training set (``allowed``: :func:`allowed_callables`)."""
    task = task_of(s.task_spec(), allowed)
    if task.client_data is None:
        parts = _partitions(s.task_spec(), allowed, s.num_clients, s.partition, s.alpha, s.seed)
        if not 0 <= key < len(parts):
            raise ClientProtocolError(f"client key {key} has no partition: the task has "
                                      f"{len(parts)} partitions (num_clients = "
                                      f"{s.num_clients})")
        idx = torch.from_numpy(parts[key])
        return task.train_x[idx], task.train_y[idx]
    if not 0 <= key < s.num_clients:
        raise ClientProtocolError(f"client key {key} has no data: num_clients = "
                                  f"{s.num_clients}")
    return task.data_of(key, s.num_clients)


def client_key(context: Context) -> int:
    """This client's stable key: its partition id in simulation, else ``client-key`` or node id."""
    for k in ("client-key", "partition-id"):
        if k in context.node_config:
            return int(context.node_config[k])
    return int(context.node_id)


def message_config(content: RecordDict, context: Context) -> ConfigRecord:
    """A train message's config: its per-node keys over the run's config.

    The run's config comes whole in the ``run_config`` record when the server does not know
    this client to hold it; it is checked against the message's ``config_digest`` and kept in
    the context's state. Otherwise the digest names it, and the context's copy is used. A
    config without a digest holds every key itself. Raises :class:`ClientProtocolError`
    (:data:`fedgc.protocol.CONFIG_MISSING` in its text, so that the server sends the config
    whole next time) when the digest names a config this client does not hold: a context
    Flower made anew, or lost state.
    """
    config = content.config_records.get(P.CONFIG)
    if config is None:
        raise ClientProtocolError(f"train message has no {P.CONFIG!r} ConfigRecord")
    digest = config.get(P.CONFIG_DIGEST)
    if digest is None:
        return config
    run = content.config_records.get(P.RUN_CONFIG)
    if run is not None:
        got = P.config_digest(run)
        if got != digest:
            raise ClientProtocolError(f"train message's {P.RUN_CONFIG!r} has digest {got}, "
                                      f"not the {P.CONFIG_DIGEST} {digest!r} it names")
        context.state[P.RUN_CONFIG] = ConfigRecord({**run, P.CONFIG_DIGEST: digest})
    else:
        kept = context.state.config_records.get(P.RUN_CONFIG)
        if kept is None or kept.get(P.CONFIG_DIGEST) != digest:
            raise ClientProtocolError(
                f"{P.CONFIG_MISSING}: the message names run config {digest!r}, which this "
                f"client does not hold ({'none' if kept is None else 'another'} kept); the "
                f"server sends it whole next round")
        run = kept
    return ConfigRecord({**{k: v for k, v in run.items() if k != P.CONFIG_DIGEST}, **config})


def settings_from(config: ConfigRecord, allowed: frozenset[str] | None) -> TrainSettings:
    """The TrainSettings keys of a message config (other keys are per-node or Flower's).

    ``allowed`` (:func:`allowed_callables`; None: any): a ``task`` or ``method`` naming a
    ``module:callable`` it lacks is refused here, before parsing, since parsing a method key
    loads the method (imports its module) to read its defaults.
    """
    values = {k: v for k, v in config.items() if k in _TRAIN_KEYS}
    for ref_key in ("task", "method"):
        ref = values.get(ref_key)
        if is_ref(ref):
            try:
                check_allowed(str(ref), ref_key, allowed)
            except CallableNotAllowedError as ex:
                raise ClientProtocolError(str(ex)) from None
    try:
        # Every message of a run carries the same settings: parse them once per process. The
        # key holds each value's type too, since 1, 1.0 and True are equal but parse apart.
        key = tuple(sorted((k, type(v).__name__, v) for k, v in values.items()))
        hash(key)
    except TypeError:  # an unhashable value (a list): parse it every time
        key = None
    try:
        return _parse_settings(key) if key is not None else parse(TrainSettings, values,
                                                                  strict=False)
    except SettingsError as ex:
        raise ClientProtocolError(f"train message config is invalid: {ex}") from ex


@lru_cache(maxsize=16)
def _parse_settings(items: tuple[tuple[str, str, Any], ...]) -> TrainSettings:
    return parse(TrainSettings, {k: v for k, _, v in items}, strict=False)


def method_of(settings: TrainSettings, config: Any,
              allowed: frozenset[str] | None) -> methods.Method:
    """The run's method, configured with its own keys from the message ``config``; a
    ``module:callable`` only if ``allowed`` (:func:`allowed_callables`, None: any) holds it."""
    try:
        return methods.get(settings.method, allowed).with_keys(dict(config.items()))
    except SettingsError as ex:
        raise ClientProtocolError(f"train message config is invalid: {ex}") from ex


def for_method(settings: TrainSettings, method: methods.Method) -> TrainSettings:
    """``settings`` with a key the server left to the method (``density`` sent empty) given
    the method's default, as the server's run config gives it."""
    try:
        return fill_fallbacks(settings, method.defaults)[0]
    except SettingsError as ex:
        raise ClientProtocolError(f"train message config is invalid: {ex}") from ex


def state_root(settings: TrainSettings, context: Context) -> str:
    """Folder of this client's state store: the node's ``state-dir``, else ``state_dir``; ""
    when neither is set."""
    return str(context.node_config.get("state-dir") or settings.state_dir)


def _store(settings: TrainSettings, context: Context) -> ClientStateStore:
    root = state_root(settings, context)
    if not root:
        raise ClientProtocolError("no state_dir in the train config and no 'state-dir' in the "
                                  "node config: the client has nowhere to keep its residual")
    return ClientStateStore(str(root))


def _int(config: ConfigRecord, key: str) -> int:
    if key not in config:
        raise ClientProtocolError(f"train message config lacks {key!r}")
    value = config[key]
    # A bool or a float is no integer here (int() would take True as 1 and cut 2.5 to 2).
    if not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return int(value)
        except ValueError:
            pass
    raise ClientProtocolError(f"train message config has {key} = {value!r}: expected an integer")


def _age_in_versions(config: ConfigRecord, version: int) -> bool:
    """Whether the server says (an asynchronous dispatch, :data:`fedgc.protocol.AGE_IN_VERSIONS`)
    that an unaggregated update's age is counted in model versions; a value other than a
    boolean, or a negative ``version`` with it, is a :class:`ClientProtocolError` naming it."""
    flag = config.get(P.AGE_IN_VERSIONS, False)
    if not isinstance(flag, bool):
        raise ClientProtocolError(f"train message config has {P.AGE_IN_VERSIONS} = {flag!r}: "
                                  f"expected true or false")
    if flag and version < 0:
        raise ClientProtocolError(f"train message config has {P.MODEL_VERSION} = {version}: "
                                  f"expected a version >= 0 to age an unaggregated update by")
    return flag


def age_version(config: ConfigRecord) -> int | None:
    """The model version an asynchronous dispatch ages a client's last update by (it says
    :data:`fedgc.protocol.AGE_IN_VERSIONS`); None for a sync round, which ages in rounds.
    A bad version or flag is a :class:`ClientProtocolError` naming it."""
    version = _int(config, P.MODEL_VERSION)
    return version if _age_in_versions(config, version) else None


def initial_model(task: Any, seed: int) -> dict[str, torch.Tensor]:
    """Version 0 of the global model, built as the server builds it (``server.app.run_server``:
    ``torch.manual_seed(seed)`` then ``task.build_model()``), without moving this process's
    random stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {k: v.detach().to(torch.float32).clone()
                for k, v in task.build_model().state_dict().items()}


#: Version 0 of the last runs this process served, by (task spec, seed); a few, as task_of.
_initial_models: OrderedDict[tuple[TaskSpec, int], dict[str, torch.Tensor]] = OrderedDict()
_initial_models_lock = threading.Lock()


def initial_model_of(spec: TaskSpec, task: Any, seed: int) -> dict[str, torch.Tensor]:
    """:func:`initial_model` of the run's task (``spec``, ``task`` its Task) and seed, built
    once per process and copied for each caller.

    A client that ranks by displacement (DGC's sets, ``downlink_context`` patches) needs version
    0 every round, once or twice; seeding torch and initialising a model each time was about a
    tenth of a ``dgc_sets`` run (docs/dgc_vs_dense.md). The copy is the same bits."""
    with _initial_models_lock:  # one build per run and seed when threads of a process race
        built = _initial_models.get((spec, seed))
        if built is None:
            built = _initial_models[(spec, seed)] = initial_model(task, seed)
            while len(_initial_models) > 4:
                _initial_models.popitem(last=False)
        _initial_models.move_to_end((spec, seed))
    return {k: v.clone() for k, v in built.items()}


def global_model(content: RecordDict, config: ConfigRecord, held: ClientState | None,
                 initial: Callable[[], dict[str, torch.Tensor]] | None = None,
                 ) -> dict[str, torch.Tensor]:
    """The global model of this message, from dense arrays or a patch on the held version.

    ``initial`` builds version 0 (:func:`initial_model`): a client that holds no model yet may
    be sent a patch on version 0 when the run has ``clients_build_initial_model``.
    """
    arrays = content.array_records.get(P.ARRAYS)
    if arrays is None:
        raise ClientProtocolError(f"train message has no {P.ARRAYS!r} ArrayRecord")
    kind = str(config.get(P.DOWNLINK, "dense"))
    if kind == "dense":
        # to_torch_state_dict deserializes each array into new memory: no copy needed.
        return dict(arrays.to_torch_state_dict())
    if kind != "patch":
        raise ClientProtocolError(f"downlink must be 'dense' or 'patch', got {kind!r}")
    base = _int(config, P.BASE_VERSION)
    bases = [int(v) for v in config.get(P.BASE_VERSIONS, [base])]  # type: ignore[union-attr]
    target = _int(config, P.MODEL_VERSION)
    model, version = (None, None) if held is None else (held.model, held.model_version)
    if model is not None and version == target:
        # A resumed server re-sends a round this client already received: it holds the target.
        return {k: v.clone() for k, v in model.items()}
    if model is None and 0 in bases and initial is not None:
        model, version = initial(), 0
        if bool(config.get(P.INITIAL_GRID, False)):
            model = round_initial(model)  # the server's version 0 of an int8 broadcast
    if model is None or version not in bases:
        on = f"version {bases[0]}" if len(bases) == 1 else f"any of versions {bases}"
        raise ClientProtocolError(f"server sent a patch on model {on}, this client holds "
                                  f"version {None if model is None else version}")
    added = config.get(P.PATCH_ADD, [])
    if not isinstance(added, list) or not all(isinstance(n, str) for n in added):
        raise ClientProtocolError(f"{P.PATCH_ADD} must be a list of tensor names, got "
                                  f"{added!r}")
    if added and len(bases) != 1:
        raise ClientProtocolError(f"a patch that adds differences applies to one version, "
                                  f"this one to {bases}")
    context = _patch_context(config, bases, initial)
    try:
        return P.apply_patch(model, P.record_to_bytes(arrays, P.PATCH), added, context)
    except P.ProtocolError as ex:
        raise ClientProtocolError(str(ex)) from ex


def _patch_context(config: ConfigRecord, bases: list[int],
                   initial: Callable[[], dict[str, torch.Tensor]] | None,
                   ) -> dict[str, torch.Tensor] | None:
    """Version 0 of the tensors a patch sends ranked by displacement (``patch_context``), or
    None when it sends none that way."""
    names = config.get(P.PATCH_CONTEXT, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ClientProtocolError(f"{P.PATCH_CONTEXT} must be a list of tensor names, got "
                                  f"{names!r}")
    if not names:
        return None
    if len(bases) != 1:
        raise ClientProtocolError(f"a patch ranked by displacement applies to one version, "
                                  f"this one to {bases}")
    if initial is None:
        raise ClientProtocolError(f"{P.PATCH_CONTEXT}: this client cannot build version 0, "
                                  f"which the patch's ranking needs")
    version0 = initial()
    if bool(config.get(P.INITIAL_GRID, False)):
        version0 = round_initial(version0)
    if unknown := sorted(set(names) - set(version0)):
        raise ClientProtocolError(f"{P.PATCH_CONTEXT} names tensors the model lacks: {unknown}")
    return {n: version0[n] for n in names}


def round_material(content: RecordDict, model: dict[str, torch.Tensor],
                   method: methods.Method) -> tuple[bytes, object] | None:
    """The round's material (DGC's shared index sets) with its bytes, decoded by ``method``;
    None when the message has none (ClientProtocolError for a method that sends none)."""
    record = content.array_records.get(P.SHARED)
    if record is None:
        return None
    part = material_of(method)
    try:
        if part is None:
            raise ValueError(f"method {method.name!r} sends no round material")
        data = P.record_to_bytes(record, P.SHARED_MASK)
        material = part.read_material(data, {k: v.numel() for k, v in model.items()})
    except (ValueError, dgc.DecodeError) as ex:
        raise ClientProtocolError(f"train message has a bad shared index set: {ex}") from ex
    return data, material


def _task_or_refusal(s: TrainSettings, allowed: frozenset[str] | None) -> Any:
    """The run's task, or a ClientProtocolError when the node does not allow its callable."""
    try:
        return task_of(s.task_spec(), allowed)
    except CallableNotAllowedError as ex:
        raise ClientProtocolError(str(ex)) from None


def _on_node(content: RecordDict) -> RecordDict:
    """``content`` with, on Ray, the node that ran this round (for ``clients.csv``)."""
    if where := node.node_info():
        content[P.NODE] = ConfigRecord(where)
    return content


def _load_state(store: ClientStateStore, key: str, ack: int,
                keeps_residual: bool) -> ClientState:
    """This client's state; a damaged record is moved aside, and a lost one given up, and the
    client starts over from the global model with an empty residual, counted.

    A client with a residual whose record the server relies on (it acknowledged an update) but
    which the store lacks, or holds only in an older copy (:func:`client.stores.read_state`
    raises StateMissingError: a lost disk, a reinstalled node, a node-local folder on a
    cluster), would otherwise fail every round it is sampled in for the rest of the run. What the
    record held since is lost either way; starting over keeps the client in the run and says so.

    What a damaged record held (residual, pending update) is gone too: its bytes failed their
    check, so not even its size can be trusted. The fresh state counts the loss, which the next
    reply reports (``state_quarantined``, summed per round in ``rounds.csv``), and is stored at
    once so that the count survives a round that fails (a patch on the model the client no
    longer holds: the server sends the dense model the next time).
    """
    try:
        return read_state(store, key, ack, keeps_residual,
                          where=node.describe()) or ClientState()
    except StateMissingError as ex:
        logger.warning("client %s: %s; it starts over from the global model with an empty "
                       "residual (reported as state_quarantined)", key, ex)
    except StateCorruptError as ex:
        if ex.path is None:
            raise
        moved = store.quarantine(ex.path)
        logger.warning("client %s: %s; moved it to %s and continues from the global model "
                       "with an empty residual (what the record held is lost)", key, ex, moved)
    state = ClientState(quarantined=1)
    store.save(key, state)
    return state


@dataclass
class RoundInput:
    """One train message read and checked, up to local training (steps 1-4 of the module
    docstring): what :func:`train` (and the batched engine, ``simulations.batched_engine``,
    for all of a round's clients at once) trains, and :func:`reply_round` answers from."""

    msg: Message
    config: ConfigRecord
    s: TrainSettings
    method: methods.Method
    server_round: int
    version: int
    ack: int
    key: int
    store: ClientStateStore
    state: ClientState
    task: Any
    train_x: torch.Tensor
    train_y: torch.Tensor
    global_state: dict[str, torch.Tensor]
    material: tuple[bytes, object] | None
    device: torch.device
    started: float
    #: The method's compressor, its residual loaded and what was lost folded back (None: the
    #: method sends its updates dense), and how many entries that fold-back restored.
    compressor: Compressor | None
    restored: int
    #: The model local training starts from: ``global_state`` unless the method's
    #: :meth:`~fedgc.methods.RoundMaterial.prepare` moved it (the pseudo-gradient sent is
    #: still taken against ``global_state``, see :func:`reply_round`).
    start: dict[str, torch.Tensor]
    attack: Attack | None = None  # a hostile client of a robustness study (client.attacks)
    #: The ``module:callable`` references this node allows (:func:`allowed_callables`).
    allowed: frozenset[str] | None = None
    #: The node's Context (secure aggregation keeps its session there between messages).
    context: Context | None = None

    @property
    def seed(self) -> int:
        """The seed of this round's local shuffling (:func:`fedgc.training.round_seed`)."""
        return round_seed(self.s.seed, self.server_round, self.key)


def read_round(msg: Message, context: Context) -> RoundInput | Message:
    """Steps 1-4: the message's settings, this client's state, data, global model and
    compressor; or the reply itself when the server re-sent a round this client already
    answered."""
    started = time.perf_counter()
    config = message_config(msg.content, context)
    allowed = allowed_callables(context)
    s = settings_from(config, allowed)
    method = method_of(s, config, allowed)
    s = secure.round_clip(for_method(s, method), config)  # adaptive clipping's clip
    part = material_of(method)
    try:
        device = devices.resolve(s.device)
    except devices.DeviceError as ex:
        raise ClientProtocolError(str(ex)) from ex
    server_round = _int(config, P.SERVER_ROUND)
    version = _int(config, P.MODEL_VERSION)
    aged_by = age_version(config)
    ack = int(config.get(P.ACK_SEQUENCE, -1))  # type: ignore[arg-type]
    key = client_key(context)
    task = _task_or_refusal(s, allowed)  # before anything is written: a refusal writes nothing
    store = _store(s, context)
    state = _load_state(store, str(key), ack, method.keeps_residual)

    train_x, train_y = client_data(s, key, allowed)
    attack = attack_of(s, key)
    if attack is not None:
        try:
            train_y = attack.labels(train_y, task.num_classes)
        except ValueError as ex:
            raise ClientProtocolError(str(ex)) from None

    reply = state.reply
    if (method.keeps_residual and not s.privacy_secagg and reply is not None
            and state.pending is not None
            and int(reply["sequence"]) == server_round and int(reply["model_version"]) == version):
        # The server re-sent a round this client already answered (a ServerApp resumed from the
        # checkpoint before it): send the same bytes again instead of training and compressing
        # a second time, which would fold the pending update back and change the residual.
        metrics = {**{k: v for k, v in reply.items() if k not in _KEPT_ONLY},
                   "compute_seconds": time.perf_counter() - started}
        return Message(_on_node(P.reply_content(state.pending, metrics, state.pending_shared)),
                       reply_to=msg)

    def initial() -> dict[str, torch.Tensor]:
        return initial_model_of(s.task_spec(), task, s.seed)

    global_state = global_model(msg.content, config, state, initial=initial)
    material = round_material(msg.content, global_state, method)
    if material is not None and part is not None:
        held = (None if state.model is None or state.model_version is None
                else (int(state.model_version), state.model))
        try:
            material = part.hold_material(*material, global_state, initial, held=held)
        except (ValueError, dgc.StateError) as ex:
            raise ClientProtocolError(f"train message has a bad shared index set: {ex}") from ex

    # Step 4: the compressor with this client's residual, and what was lost folded back before
    # training, since the method may start local training from a model its residual moves
    # (RoundMaterial.prepare: step-ahead feedback) or age the residual (rounds away).
    restored = 0
    start = global_state
    decoded = None if material is None else material[1]
    # Under secure aggregation a seeded method draws every client's positions from one seed.
    compressor = (client_compressor(method, s, key, decoded) if s.privacy_secagg
                  else method.compressor(s, key, decoded))
    if compressor is not None:
        if method.keeps_residual and state.compressor is not None:
            compressor.load_state_dict(state.compressor)
            # An update the server never aggregated (deadline, lost link, rejected) goes back
            # into the residual as far as the method keeps it (Method.unaggregated: whole,
            # decayed by its age, capped, or none); an asynchronous dispatch ages it in model
            # versions (applied steps), its sequences counting dispatches.
            restored = int(fold_back_pending(
                compressor, state, ack, {k: tuple(v.shape) for k, v in global_state.items()},
                method, s, server_round, aged_by))
        # Rounds away less one; an asynchronous dispatch counts applied steps, as the fold-back
        # above ages (a dispatch on the version the last update trained on: 0).
        away = -1 if state.reply is None else update_age(
            state.reply, int(state.reply["sequence"]), server_round,
            aged_by) - 1
        if aged_by is not None:
            away = max(0, away)
        if part is not None:
            start = part.prepare(s, compressor, global_state, away)
    return RoundInput(msg, config, s, method, server_round, version, ack, key, store, state,
                      task, train_x, train_y, global_state, material, device, started,
                      compressor, restored, start, attack, allowed, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on this client's partition and reply with the encoded pseudo-gradient."""
    torch.set_num_threads(1)  # one core per simulated client; Ray gives each actor one CPU
    r = read_round(msg, context)
    if isinstance(r, Message):
        return r
    s = r.s
    model = _model(r.task, s.task_spec(), r.device)
    model.load_state_dict(r.start)
    local = train_locally(
        model, r.train_x, r.train_y, r.task.training_loss, lr=s.lr,
        batch_size=s.batch_size, local_epochs=s.local_epochs, local_steps=s.local_steps,
        momentum=s.client_momentum, weight_decay=s.weight_decay, seed=r.seed)
    return reply_round(r, local)


def reply_round(r: RoundInput, local: LocalResult) -> Message:
    """Steps 6-8 after local training (step 5, from ``r.start``): compress (on the device the
    pseudo-gradient is on), encode, store the new state on the host, and the reply."""
    s, method, server_round, state = r.s, r.method, r.server_round, r.state
    keeps_residual = method.keeps_residual
    if r.attack is not None:
        # A hostile client of a robustness study (client/attacks.py): its attack replaces its
        # work before the method compresses it, so it takes the path of every update.
        benign = _benign(r) if r.attack.colluding else None
        local.pseudo_gradient = r.attack.update(local.pseudo_gradient, r.seed, benign)
        local.num_examples = r.attack.claimed_examples(local.num_examples, benign)
    restored = r.restored
    shared_data: bytes | None = None
    new_state = ClientState()
    compressor = r.compressor
    pseudo_gradient = local.pseudo_gradient
    if r.start is not r.global_state:  # the pseudo-gradient is taken against the model sent
        pseudo_gradient = {k: v + (r.global_state[k] - r.start[k]).to(v.device)
                           for k, v in pseudo_gradient.items()}
    bit = secure.clip_bit(pseudo_gradient, s)  # adaptive clipping: within the clip?
    pseudo_gradient = secure.clipped(pseudo_gradient, s)  # DP: before compression
    shapes = {k: tuple(v.shape) for k, v in r.global_state.items()}
    material = None if r.material is None else r.material[1]
    if compressor is None:
        update = SparseUpdate.from_dense(pseudo_gradient, "float32", sequence=server_round)
    else:
        update = compressor.compress(pseudo_gradient, epoch=float(server_round - 1),
                                     sequence=server_round)
    if method.sets_only(s):  # a per-client top-k goes back to the residual: secure
        # aggregation cannot sum it, central DP would need noise at every coordinate for it
        update = secure.held_back(method, s, compressor, update, shapes, material, server_round)
    if compressor is not None:
        part = material_of(method)
        side = (part.side_part(compressor, r.material[1], server_round)
                if r.material is not None and part is not None else None)
        if side is not None:
            shared_data = side[0]
        if keeps_residual:
            new_state.compressor = compressor.state_dict()  # on the host
    data = method.codec(s).encode(update)
    if keeps_residual:
        new_state.pending = data
        if r.material is not None:  # what the payload and its side part answered
            new_state.pending_mask = r.material[0]
        if shared_data is not None:
            new_state.pending_shared = shared_data
    if bool(r.config.get(P.KEEP_MODEL, False)):
        # Keep the model this client now holds, so the server may send a patch next time.
        new_state.model = r.global_state
        new_state.model_version = r.version
    metrics = P.reply_metrics(
        num_examples=local.num_examples, train_loss=local.train_loss,
        compute_seconds=time.perf_counter() - r.started, restored=restored,
        state_quarantined=state.quarantined > 0)
    if bit is not None:
        metrics[P.DP_CLIP_BIT] = bit
    if keeps_residual:
        new_state.reply = {**{k: v for k, v in metrics.items() if k != "compute_seconds"},
                           "sequence": server_round, "model_version": r.version}
    r.store.save(str(r.key), new_state)
    if s.privacy_secagg:  # the masked vector in place of the payload
        return Message(_on_node(secure.masked_content(
            r.msg, r.context, r.key, s, method, data, shared_data, material, shapes, metrics,
            server_round, r.seed, bit)), reply_to=r.msg)
    return Message(_on_node(P.reply_content(data, metrics, shared_data)), reply_to=r.msg)


def _benign(r: RoundInput) -> Benign:
    """What a colluding hostile client knows of the round's benign updates
    (:mod:`client.collusion`): learnt once a round by the first colluder, shared through the
    client state folder."""
    s = r.s
    keys = known_keys(s.attack_knowledge, parse_attack_clients(s.attack_clients),
                      s.num_clients)
    tag = {"round": r.server_round, "version": r.version,
           "model": model_digest(r.global_state)}
    return CollusionStore(r.store.root).learn(tag, keys, lambda key: _honest_update(r, key))


def _honest_update(r: RoundInput, key: int) -> tuple[dict[str, torch.Tensor], int]:
    """Client ``key``'s honest pseudo-gradient this round, trained as that client trains (its
    data, its round seed) from the model sent, and its number of examples; torch's random
    stream is left as it was."""
    s = r.s
    x, y = client_data(s, key, r.allowed)
    model = _model(r.task, s.task_spec(), r.device)
    model.load_state_dict(r.global_state)
    with torch.random.fork_rng(devices=[]):
        local = train_locally(
            model, x, y, r.task.training_loss, lr=s.lr, batch_size=s.batch_size,
            local_epochs=s.local_epochs, local_steps=s.local_steps, momentum=s.client_momentum,
            weight_decay=s.weight_decay, seed=round_seed(s.seed, r.server_round, key))
    return local.pseudo_gradient, local.num_examples


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the sent (dense) model on this client's partition (federated evaluation)."""
    torch.set_num_threads(1)
    config = msg.content.config_records.get(P.CONFIG) or ConfigRecord()
    allowed = allowed_callables(context)
    s = settings_from(config, allowed)
    task = _task_or_refusal(s, allowed)
    x, y = client_data(s, client_key(context), allowed)
    device = devices.resolve(s.device)
    model = _model(task, s.task_spec(), device)
    model.load_state_dict(msg.content.array_records[P.ARRAYS].to_torch_state_dict())
    model.eval()
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        out = model(x)
        loss = float(task.loss_fn(out, y))
        pred = out.argmax(-1)
        accuracy = float((pred == y).float().mean())
    metrics = MetricRecord({"num-examples": int(len(y)), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)


@app.query(P.SECAGG_ACTION)
def secagg_stage(msg: Message, context: Context) -> Message:
    """Answer a secure-aggregation stage that no train message carries (setup, share keys,
    unmask: :mod:`client.secure`)."""
    return secure.answer_stage(msg, context, client_key(context))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server this client's stable key (node ids change with every simulation run)."""
    return Message(RecordDict({P.METRICS: MetricRecord({P.CLIENT_KEY: client_key(context)})}),
                   reply_to=msg)
