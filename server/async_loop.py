"""The asynchronous buffered loop (FedBuff): keep C clients training, apply an update every K
replies, each weighted by how stale the model it trained on is.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS 2022), as
:func:`run_async` runs it on any Flower ``Grid``:

1. dispatch: ``async.concurrency`` (C) clients train at once. A client that replied is replaced
   by one sampled among the idle ones (the registry's seeded sampling, one draw per dispatch),
   sent the current model as a synchronous round sends it (dense, or a patch on a version it
   holds) and tagged with a dispatch sequence of its own, which its update carries back;
2. collect: replies are pulled as they come (``push_messages`` / ``pull_messages``: fedgc's
   in-process grid, Flower's simulation engine, a deployment). Each is checked as a round's
   reply is. Its staleness ``s`` is the number of steps applied since the version it trained
   on; one staler than ``async.max_staleness`` is refused (reason ``stale``) and counted;
3. apply: every ``async.buffer`` (K) accepted replies, the strategy's own step on the buffer
   (the defences, the method's aggregator, the server optimizer and its momentum), each update
   scaled by :func:`staleness_weight`: ``sum(w_i * g(s_i) * u_i) / sum(w_i)``. An applied step
   is a round of the results (``rounds.csv``): evaluated, recorded, checkpointed.

A client's acknowledgement is the dispatch sequence of its last accepted reply, given as soon
as the reply enters the buffer (it will be applied); a refused reply is not acknowledged, so
an error-feedback client folds it back into its residual on its next dispatch, as after a
synchronous round that did not take it (docs/async.md: DGC under staleness). Every dispatch
says (``age_in_versions``) that the age of such an update is counted in model versions, that
is in applied steps, not in dispatch sequences.

Which reply comes next: under an extension's clock (the network emulator, each client on its
own virtual timeline: download, compute, upload, drop-outs), the one that reaches the server
first on that clock, once every reply in flight is in (so that the order does not depend on
the engine); without one, as they come, and on the in-process grid (which runs a client when
its reply is pulled) the oldest dispatch first, so that every client takes one dispatch's time.
Either way an in-process run is reproducible.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedgc import protocol as P
from fedgc.settings import RunConfig, SettingsError
from server.checkpoint import CheckpointError
from server.extensions import Arrival, Reply, RoundExtension, apply_extensions
from server.local_grid import LocalGrid
from server.loop import resume_from_checkpoint
from server.records import (
    ClientRow,
    RoundRecord,
    RunRecords,
    client_row,
    round_record,
    train_metrics,
)
from server.registry import ClientRegistry, RoundOutcome
from server.replies import CheckedReply, ReplyChecker


class AsyncStrategy(Protocol):
    """What the loop asks of a strategy (:class:`server.strategy.DGCStrategy` is one, and
    imports this module: a Protocol keeps the two free of an import cycle)."""

    settings: RunConfig
    extensions: list[RoundExtension]
    registry: ClientRegistry
    checker: ReplyChecker
    records: RunRecords
    probe_timeout: float
    resume: bool
    checkpoint_dir: Path | None
    completed_rounds: int
    round_record: RoundRecord
    rounds: list[RoundRecord]
    async_state: dict[str, Any] | None

    @property
    def model_version(self) -> int: ...
    @property
    def dense_update_nbytes(self) -> int: ...
    @property
    def dense_model_nbytes(self) -> int: ...
    @property
    def dense_downlink_only(self) -> bool: ...
    def summary(self) -> None: ...
    def set_model(self, arrays: ArrayRecord) -> None: ...
    def load_state_dict(self, state: Any) -> None: ...
    def model_arrays(self) -> ArrayRecord: ...
    def keep_round(self, record: RoundRecord) -> None: ...
    def train_messages(self, server_round: int, node_of: dict[int, int],
                       config: ConfigRecord) -> tuple[Any, list[Message]]: ...
    def aggregate_buffer(self, step: int, replies: list[CheckedReply],
                         rows: Mapping[int, ClientRow], scale: Sequence[float]) -> bool: ...

#: Seconds before pulling again a grid that had no reply ready, doubled after each empty pull
#: up to :data:`PULL_INTERVAL_MAX_S` (Flower's own ``send_and_receive`` polls every 3 s).
PULL_INTERVAL_S = 0.05
#: The longest wait between two pulls: a deployment's grid is a SuperLink over HTTP, and a pull
#: every 50 ms for the minutes a SuperNode's ClientApp takes cost the shared cores the
#: ClientApps train on; a reply waits at most this long to be seen.
PULL_INTERVAL_MAX_S = 1.0


def pull_interval(empty_pulls: int) -> float:
    """Seconds to wait after ``empty_pulls`` pulls in a row brought no reply (>= 1): 50 ms,
    doubled each time, at most :data:`PULL_INTERVAL_MAX_S`.

    >>> [pull_interval(n) for n in (1, 2, 5, 9)]
    [0.05, 0.1, 0.8, 1.0]
    """
    if empty_pulls < 1:
        raise ValueError(f"empty_pulls must be >= 1, got {empty_pulls}")
    return min(PULL_INTERVAL_S * 2.0 ** min(empty_pulls - 1, 32), PULL_INTERVAL_MAX_S)


def staleness_weight(staleness: int, how: str, exponent: float) -> float:
    """The weight of a reply trained on a model ``staleness`` applied steps old.

    ``polynomial``: ``(1 + s) ** -exponent`` (FedBuff's ``1 / sqrt(1 + s)`` at 0.5; APPFL's
    polynomial family; ``async.staleness`` and ``async.staleness_exponent`` give ``how`` and
    ``exponent``); ``constant``: 1.

    >>> staleness_weight(3, "polynomial", 0.5)
    0.5
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if how == "constant":
        return 1.0
    if how == "polynomial":
        return float((1 + staleness) ** -exponent)
    raise ValueError(f"async.staleness must be polynomial or constant, got {how!r}")


@dataclass
class _InFlight:
    """One dispatched train message, not yet answered."""

    key: int  # the client
    wave: Any  # the strategy's record of what this dispatch sent (server.strategy._Round)
    pushed: float  # time.monotonic() when pushed
    start_s: float = 0.0  # when it left on the extensions' clock (0 without one)
    content: bytes = b""  # the message's content as sent (serialized: the checkpoint's copy)
    # Answered before the last step (a reply waiting on the clock when the checkpoint was
    # written, pulled again after a resume): not an answer since the step.
    answered_before: bool = False


@dataclass
class _Wave:
    """What one fill sent, as a checkpoint keeps it (the fields of server.strategy._Round
    that the loop reads)."""

    server_round: int  # the dispatch sequence
    node_of: dict[int, int]
    version_sent: int
    config_digest: str
    downlink: dict[int, tuple[str, int]]
    material: Any


@dataclass
class _Buffered:
    """An accepted reply waiting for its step."""

    reply: CheckedReply
    staleness: int
    row: ClientRow


class AsyncLoop:
    """The state of one asynchronous run on ``grid`` (see the module docstring)."""

    def __init__(self, strategy: AsyncStrategy, grid: Grid, timeout: float,
                 train_config: ConfigRecord) -> None:
        s = strategy.settings.server
        self.strategy, self.grid, self.timeout = strategy, grid, timeout
        self.train_config = train_config
        self.concurrency, self.buffer_size = s.async_concurrency, s.async_buffer
        self.max_staleness = s.async_max_staleness
        self.weight_of = (s.async_staleness, s.async_staleness_exponent)
        self.inflight: dict[str, _InFlight] = {}  # message id -> dispatch, in push order
        self.buffer: list[_Buffered] = []
        self.rows: list[ClientRow] = []  # every reply and timeout since the last step
        self.uplink_bytes = 0  # of those replies
        self.sequence = 0  # the last dispatch sequence used
        self.in_process = _innermost(grid)
        # With an extension's clock (the network emulator) replies are taken in the order
        # they reach the server on it: every reply in flight must be in before the earliest
        # is known, so they wait in a heap of (arrival, dispatch sequence, client key).
        self.extensions = strategy.extensions
        self.clocked = any(ext.clocked for ext in self.extensions)
        self.now_s = self.step_start_s = 0.0  # the clock's time, and at the last step
        self.ready: list[tuple[float, int, int, _InFlight, Message, Arrival | None]] = []
        # Without a clock, replies pulled together (Ray's actors, a deployment) beyond what
        # the buffer takes wait here, in the order they came, for the next step: a step
        # applies exactly K replies.
        self.held: collections.deque[tuple[_InFlight, Message]] = collections.deque()
        self.replies: list[Reply] = []  # every reply since the last step, as they came
        # Clients that answered since the last step wait for the next one before they train
        # again: one answer per client between two checkpoints, which a resume replays
        # (client/app.py answers a dispatch it answered last with the same bytes).
        self.answered: set[int] = set()

    # ------------------------------------------------------------------ dispatch
    def fill(self) -> None:
        """Dispatch idle clients until ``concurrency`` train at once."""
        # A reply waiting in the clock's heap has not reached the server yet: still busy.
        busy = ({d.key for d in self.inflight.values()} | {r[2] for r in self.ready}
                | {d.key for d, _ in self.held})
        need = self.concurrency - len(self.inflight) - len(self.ready) - len(self.held)
        if need <= 0:
            return
        if busy or len(self.answered) < self.strategy.settings.train.num_clients:
            busy |= self.answered
        else:
            # Every client answered since the last step and none is in flight (replies
            # dropped or refused): the loop would stop; resume is then replayed as far as it
            # can be (docs/async.md, Limits).
            log(WARNING, "async: every client answered since the last step (model version %d) "
                "and none is in flight: dispatching again before the next step",
                self.strategy.model_version)
        st = self.strategy
        self.sequence += 1
        # The first fill waits for C connected nodes, as a round waits for its clients; later
        # ones do not: in a deployment a SuperNode may be gone (crashed, restarting under a
        # new node id), and waiting for it would leave the replies in flight untaken.
        in_flight = bool(self.inflight or self.ready or self.held)
        # Sample more than needed so that enough of them are idle, in the draw's order.
        node_of, _ = st.registry.sample_round(
            self.grid, self.sequence, need + len(busy), 1 if in_flight else self.concurrency,
            st.probe_timeout)
        chosen = {k: n for k, n in node_of.items() if k not in busy}
        chosen = dict(list(chosen.items())[:need])
        if not chosen:
            return
        for ext in self.extensions:
            ext.dispatch_at(self.now_s)
        wave, messages = st.train_messages(self.sequence, chosen, self.train_config)
        for message in messages:
            # The loop spends a dispatch sequence per fill (about K per applied step): a
            # client ages an update the server never aggregated in model versions instead
            # (docs/async.md, "The age of an unaggregated update").
            message.content[P.CONFIG][P.AGE_IN_VERSIONS] = True
        # Serialized before the push: a grid may hand the message itself to its client.
        contents = [_serialize(m.content) for m in messages]
        now = time.monotonic()
        for key, mid, content in zip(chosen, self.grid.push_messages(messages), contents,
                                     strict=True):
            self.inflight[mid] = _InFlight(key, wave, now, self.now_s, content)

    # ------------------------------------------------------------------ collect
    def collect(self) -> list[tuple[_InFlight, Message, Arrival | None]]:
        """The next reply: the next as they come in real time (replies pulled together wait
        in :attr:`held`), or with a clock the one that reaches the server first on it (the
        clock moves to its arrival)."""
        if not self.clocked:
            if not self.held:
                self.held.extend(self.pulled())
            return [(*self.held.popleft(), None)] if self.held else []
        while self.inflight:
            for dispatch, msg in self.pulled(every=True):
                arrival = None
                for ext in self.extensions:
                    arrival = arrival or ext.arrival(Reply(msg, dispatch.key))
                # A reply without a timeline (an error) arrives as it was sent.
                at_s = dispatch.start_s if arrival is None else max(arrival.at_s,
                                                                    dispatch.start_s)
                heapq.heappush(self.ready, (at_s, dispatch.wave.server_round, dispatch.key,
                                            dispatch, msg, arrival))
        if not self.ready:
            return []
        at_s, _, _, dispatch, msg, arrival = heapq.heappop(self.ready)
        self.now_s = max(self.now_s, at_s)
        return [(dispatch, msg, arrival)]

    def pulled(self, every: bool = False) -> list[tuple[_InFlight, Message]]:
        """Replies pulled from the grid (at least one, unless dispatches timed out as rows);
        the in-process grid runs the oldest dispatch only, unless ``every``."""
        empty = 0
        while True:
            if self.in_process and not every:
                # The in-process grid runs a client as its reply is pulled: the oldest first.
                ids = [next(iter(self.inflight))]
            else:
                ids = list(self.inflight)
            replies = list(self.grid.pull_messages(ids))
            out = []
            for msg in replies:
                dispatch = self.inflight.pop(msg.metadata.reply_to_message_id, None)
                if dispatch is not None:
                    if not dispatch.answered_before:
                        self.answered.add(dispatch.key)
                    out.append((dispatch, msg))
                else:
                    self.strategy.records.count_rejection("reply to no dispatch in flight")
            if self.in_process:
                # Dropped on the way (the in-process grid's intercept): they will never come.
                for mid in [m for m in ids if m in self.inflight]:
                    self.answered.add(self.inflight[mid].key)  # it ran
                    self.timed_out(self.inflight.pop(mid), "reply dropped on the way")
            if out or self.expire() or not self.inflight:
                return out
            empty += 1
            time.sleep(pull_interval(empty))

    def expire(self) -> bool:
        """Drop the dispatches older than the timeout; whether any was."""
        now = time.monotonic()
        old = [mid for mid, d in self.inflight.items() if now - d.pushed > self.timeout]
        for mid in old:
            self.timed_out(self.inflight.pop(mid))
        return bool(old)

    def timed_out(self, dispatch: _InFlight,
                  reason: str = "no reply before round_timeout_s") -> None:
        """A timeout row for a dispatch no longer in flight, as a synchronous round writes."""
        wave = dispatch.wave
        kind, down = wave.downlink[dispatch.key]
        self.rows.append(ClientRow(0, dispatch.key, wave.node_of[dispatch.key], "timeout",
                                   reason, kind, down))
        self.settle(dispatch, "timeout")

    def take(self, dispatch: _InFlight, msg: Message, arrival: Arrival | None = None) -> None:
        """Check one reply against the dispatch that sent it; buffer it or refuse it. One
        whose ``arrival`` failed (the clock's link went down) never reached the server: a
        ``dropped`` row, not acknowledged."""
        st, wave, key = self.strategy, dispatch.wave, dispatch.key
        self.replies.append(Reply(msg, key))
        if arrival is not None and not arrival.ok:
            kind, down = wave.downlink[key]
            self.rows.append(ClientRow(0, key, wave.node_of[key], "dropped", arrival.reason,
                                       kind, down))
            # One that sent an update trained on the model it was sent: it holds it.
            trained = not msg.has_error() and P.UPDATE in msg.content.array_records
            st.registry.settle(wave.server_round, [RoundOutcome(key, "timeout")],
                               version_sent=wave.version_sent,
                               processed=[key] if trained else [],
                               dense_only=st.dense_downlink_only,
                               config_digest=wave.config_digest)
            return
        [checked] = st.checker.check_round(wave.server_round, [msg],
                                           lambda m: (key, wave.node_of[key]), [key],
                                           wave.material)
        row = client_row(0, checked, wave.downlink[key], st.dense_update_nbytes)
        self.rows.append(row)
        self.uplink_bytes += checked.uplink_bytes
        staleness = st.model_version - wave.version_sent
        row.extra["staleness"] = staleness
        if checked.status == "valid" and staleness > self.max_staleness:
            row.status = "rejected"
            row.reason = (f"stale: trained on version {wave.version_sent}, {staleness} steps "
                          f"old (async.max_staleness = {self.max_staleness})")
            st.records.count_rejection("stale")
            log(INFO, "\t> Refused reply of client %d: %s", key, row.reason)
        elif checked.status == "valid":
            row.status = "aggregated"
            self.buffer.append(_Buffered(checked, staleness, row))
        elif checked.status == "rejected":
            st.records.count_rejection(checked.reason.split(":")[0])
            log(WARNING, "\t> Rejected reply of client %d: %s", key, checked.reason)
        else:
            log(INFO, "\t> Error in reply of client %d: %s", key, checked.reason)
        self.settle(dispatch, row.status, row.reason)

    def settle(self, dispatch: _InFlight, status: str, reason: str = "") -> None:
        """Tell the registry how a dispatch ended: acknowledged (in the buffer) or not, and
        the version the client now holds."""
        st, wave = self.strategy, dispatch.wave
        st.registry.settle(wave.server_round, [RoundOutcome(dispatch.key, status, reason)],
                           version_sent=wave.version_sent,
                           dense_only=st.dense_downlink_only,
                           config_digest=wave.config_digest)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What is in flight after an applied step (the buffer and the step's rows are empty
        then): every dispatch not yet taken, in the order it was pushed, with the content it
        was sent; the dispatch sequence and the clock. A resumed run sends them again
        (:meth:`resend`)."""
        answered = [r[3] for r in self.ready] + [d for d, _ in self.held]  # pulled before it
        before = {id(d) for d in answered}
        dispatches = [*self.inflight.values(), *answered]
        dispatches.sort(key=lambda d: (d.wave.server_round,
                                       list(d.wave.node_of).index(d.key)))
        waves: dict[str, dict[str, Any]] = {}
        unsaved = ""
        for d in dispatches:
            w = d.wave
            material = _material_state(w.material)
            if w.material is not None and material is None:
                unsaved = unsaved or type(w.material).__name__
            waves[str(w.server_round)] = {
                "node_of": {str(k): n for k, n in w.node_of.items()},
                "version_sent": w.version_sent, "config_digest": w.config_digest,
                "downlink": {str(k): [kind, n] for k, (kind, n) in w.downlink.items()},
                "material": material}
        return {"sequence": self.sequence, "now_s": self.now_s,
                "step_start_s": self.step_start_s, "waves": waves,
                "dispatches": [{"key": d.key, "sequence": d.wave.server_round,
                                "start_s": d.start_s, "answered": id(d) in before,
                                "content": torch.frombuffer(bytearray(d.content),
                                                            dtype=torch.uint8)}
                               for d in dispatches],
                "unsaved_material": unsaved}

    def resend(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: push the dispatches that were in flight again,
        in their order, with the content they were sent. A client that answered one before
        the run stopped answers it again with the same bytes (client/app.py: a re-sent
        dispatch), so that the run goes on as if it had not stopped."""
        if state["unsaved_material"]:
            raise CheckpointError(
                f"this asynchronous checkpoint cannot be resumed: its dispatches in flight "
                f"carry round material of type {state['unsaved_material']}, which the "
                f"checkpoint does not keep (docs/async.md, Checkpoint and resume)")
        self.sequence = int(state["sequence"])
        self.now_s, self.step_start_s = float(state["now_s"]), float(state["step_start_s"])
        waves = {int(seq): _Wave(int(seq), {int(k): int(n) for k, n in w["node_of"].items()},
                                 int(w["version_sent"]), str(w["config_digest"]),
                                 {int(k): (str(kind), int(n))
                                  for k, (kind, n) in w["downlink"].items()},
                                 _material_of(w["material"]))
                 for seq, w in state["waves"].items()}
        sent, messages = [], []
        for d in state["dispatches"]:
            wave, content = waves[int(d["sequence"])], bytes(d["content"].numpy())
            key, record = int(d["key"]), _deserialize(content)
            if not self.strategy.registry.holds_config(key, wave.config_digest):
                # Clients keep the run config in memory: a resumed server sends it again.
                record[P.RUN_CONFIG] = ConfigRecord(dict(self.train_config))
            messages.append(Message(record, dst_node_id=wave.node_of[key],
                                    message_type=MessageType.TRAIN,
                                    group_id=str(wave.server_round)))
            sent.append(_InFlight(key, wave, 0.0, float(d["start_s"]), content,
                                  bool(d["answered"])))
        now = time.monotonic()
        for dispatch, mid in zip(sent, self.grid.push_messages(messages), strict=True):
            dispatch.pushed = now
            self.inflight[mid] = dispatch
        if not sent:
            return
        # Named in the log: a deployment's test matches it against the checkpoint it resumed.
        log(INFO, "async: sent again %d dispatch(es) in flight at the checkpoint: %s",
            len(sent), ", ".join(f"client {d.key} (dispatch {d.wave.server_round})"
                                 for d in sent))

    # ------------------------------------------------------------------ apply
    def apply(self, step: int) -> bool:
        """The strategy's step on the buffer, each update scaled by its staleness weight;
        whether the model moved. The buffer's rows become the step's record."""
        st = self.strategy
        taken, self.buffer = self.buffer, []
        replies = [b.reply for b in taken]
        scale = [staleness_weight(b.staleness, *self.weight_of) for b in taken]
        # The defences' notes go to a client's row (its later one, with two in the buffer).
        by_key = {b.reply.client_key: b.row for b in taken}
        applied = st.aggregate_buffer(step, replies, by_key, scale)
        if not applied:
            for b in taken:
                b.row.status, b.row.reason = "rejected", "aggregate was not finite"
        for row in self.rows:
            row.round = step
        record = round_record(step, self.rows, self.uplink_bytes, st.dense_update_nbytes,
                              st.dense_model_nbytes, st.model_version)
        record.clients_failed += sum(row.status == "dropped" for row in self.rows)
        elapsed, rows, replies = self.now_s - self.step_start_s, self.rows, self.replies
        apply_extensions(self.extensions, record, rows,
                         lambda ext: ext.after_step(record, rows, replies, elapsed))
        st.records.client_rows.extend(self.rows)
        st.round_record = record
        self.rows, self.uplink_bytes, self.replies = [], 0, []
        self.answered = set()
        self.step_start_s = self.now_s
        log(INFO, "async step %d: %d applied (staleness %s), model version %d", step,
            len(taken), [b.staleness for b in taken], st.model_version)
        return applied


def _serialize(content: RecordDict) -> bytes:
    return recorddict_to_proto(content).SerializeToString()


def _deserialize(data: bytes) -> RecordDict:
    return recorddict_from_proto(RecordDictProto.FromString(data))


def _material_state(material: object) -> dict[str, Any] | None:
    """A dispatch's decoded round material as a checkpoint keeps it: index sets or masks by
    tensor name (numpy arrays or tensors); None for none, or for another kind."""
    if not isinstance(material, Mapping) or not all(isinstance(k, str) for k in material):
        return None
    if all(isinstance(v, np.ndarray) for v in material.values()):
        return {"numpy": {k: torch.from_numpy(v.copy()) for k, v in material.items()}}
    if all(isinstance(v, torch.Tensor) for v in material.values()):
        return {"torch": dict(material)}
    return None


def _material_of(state: Mapping[str, Any] | None) -> object:
    """The material :func:`_material_state` kept."""
    if state is None:
        return None
    if "numpy" in state:
        return {k: v.numpy() for k, v in state["numpy"].items()}
    return dict(state["torch"])


def _innermost(grid: Grid) -> bool:
    """Whether ``grid`` is (or wraps) fedgc's in-process grid."""
    while not isinstance(grid, LocalGrid):
        inner = getattr(grid, "grid", None)
        if not isinstance(inner, Grid):
            return False
        grid = inner
    return True


def run_async(strategy: AsyncStrategy, grid: Grid, initial_arrays: ArrayRecord,
              num_rounds: int, timeout: float, train_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
    """Run applied steps ``completed_rounds + 1 .. num_rounds`` of FedBuff on ``grid`` (module
    docstring): the asynchronous counterpart of :func:`server.loop.run_rounds`, with the same
    strategy, records, results and checkpoints.

    A checkpoint after each step holds the dispatches in flight (:meth:`AsyncLoop.state_dict`);
    with ``resume = true`` they are sent again, as they were, before anything new.

    Raises
    ------
    SettingsError
        With more than one extension keeping a clock.
    CheckpointError
        A resume without a checkpoint, or of one whose dispatches cannot be sent again.
    """
    if sum(ext.clocked for ext in strategy.extensions) > 1:
        raise SettingsError("mode = async takes replies on one clock: several extensions "
                            "keep one")
    log(INFO, "Starting %s strategy, asynchronous (FedBuff):", strategy.__class__.__name__)
    strategy.summary()
    strategy.set_model(initial_arrays)
    resume_from_checkpoint(strategy)
    loop = AsyncLoop(strategy, grid, timeout,
                     ConfigRecord() if train_config is None else train_config)
    if strategy.async_state is not None and strategy.completed_rounds > 0:
        loop.resend(strategy.async_state)
    result = Result()
    for r in strategy.rounds:
        result.evaluate_metrics_serverapp[r.round] = MetricRecord(
            {"accuracy": r.accuracy, "loss": r.loss})
    if evaluate_fn is not None and strategy.completed_rounds == 0:
        res = evaluate_fn(0, strategy.model_arrays())
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    started = time.time()
    for step in range(strategy.completed_rounds + 1, num_rounds + 1):
        while len(loop.buffer) < loop.buffer_size:
            loop.fill()
            if not loop.inflight and not loop.ready and not loop.held:
                raise RuntimeError("no client could be dispatched: the registry sampled none")
            for dispatch, msg, arrival in loop.collect():
                loop.take(dispatch, msg, arrival)
        loop.apply(step)
        record = strategy.round_record
        result.train_metrics_clientapp[step] = MetricRecord(train_metrics(record))
        if evaluate_fn is not None:
            res = evaluate_fn(step, strategy.model_arrays())
            if res is not None:
                result.evaluate_metrics_serverapp[step] = res
                record.accuracy = float(res.get("accuracy", float("nan")))  # type: ignore
                record.loss = float(res.get("loss", float("nan")))  # type: ignore
        record.wall_seconds = time.time() - started
        started = time.time()
        strategy.async_state = loop.state_dict()
        strategy.keep_round(record)
    result.arrays = strategy.model_arrays()
    return result
