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
synchronous round that did not take it (docs/async.md: DGC under staleness).

The in-process grid runs a client when its reply is pulled: the loop pulls the oldest
dispatch first, so an in-process run is reproducible and every client takes one dispatch's
time (the network emulator's per-client timelines are not wired to this loop yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedgc.settings import SettingsError
from server.local_grid import LocalGrid
from server.records import ClientRow, client_row, round_record, train_metrics
from server.registry import RoundOutcome
from server.replies import CheckedReply

if TYPE_CHECKING:
    from server.strategy import DGCStrategy

#: Seconds between two pulls of a grid that had no reply ready (Flower's own grids poll too).
PULL_INTERVAL_S = 0.05


def staleness_weight(staleness: int, how: str = "polynomial", exponent: float = 0.5) -> float:
    """The weight of a reply trained on a model ``staleness`` applied steps old.

    ``polynomial``: ``(1 + s) ** -exponent`` (FedBuff's ``1 / sqrt(1 + s)`` at 0.5; APPFL's
    polynomial family); ``constant``: 1.

    >>> staleness_weight(3)
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


@dataclass
class _Buffered:
    """An accepted reply waiting for its step."""

    reply: CheckedReply
    staleness: int
    row: ClientRow


class AsyncLoop:
    """The state of one asynchronous run on ``grid`` (see the module docstring)."""

    def __init__(self, strategy: DGCStrategy, grid: Grid, timeout: float,
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

    # ------------------------------------------------------------------ dispatch
    def fill(self) -> None:
        """Dispatch idle clients until ``concurrency`` train at once."""
        need = self.concurrency - len(self.inflight)
        if need <= 0:
            return
        st = self.strategy
        busy = {d.key for d in self.inflight.values()}
        self.sequence += 1
        # Sample more than needed so that enough of them are idle, in the draw's order.
        node_of, _ = st.registry.sample_round(
            self.grid, self.sequence, need + len(busy), self.concurrency, st.probe_timeout)
        chosen = {k: n for k, n in node_of.items() if k not in busy}
        chosen = dict(list(chosen.items())[:need])
        if not chosen:
            return
        wave, messages = st.train_messages(self.sequence, chosen, self.train_config)
        now = time.monotonic()
        for key, mid in zip(chosen, self.grid.push_messages(messages), strict=True):
            self.inflight[mid] = _InFlight(key, wave, now)

    # ------------------------------------------------------------------ collect
    def collect(self) -> list[tuple[_InFlight, Message]]:
        """The replies that came (at least one, or the dispatches that timed out as
        rows)."""
        while True:
            if self.in_process:
                # The in-process grid runs a client as its reply is pulled: the oldest first.
                ids = [next(iter(self.inflight))]
            else:
                ids = list(self.inflight)
            replies = list(self.grid.pull_messages(ids))
            out = []
            for msg in replies:
                dispatch = self.inflight.pop(msg.metadata.reply_to_message_id, None)
                if dispatch is not None:
                    out.append((dispatch, msg))
                else:
                    self.strategy.records.count_rejection("reply to no dispatch in flight")
            if self.in_process and not replies:
                # Dropped on the way (the in-process grid's intercept): it will never come.
                self.timed_out(self.inflight.pop(ids[0]), "reply dropped on the way")
            if out or self.expire():
                return out
            time.sleep(PULL_INTERVAL_S)

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

    def take(self, dispatch: _InFlight, msg: Message) -> None:
        """Check one reply against the dispatch that sent it; buffer it or refuse it."""
        st, wave, key = self.strategy, dispatch.wave, dispatch.key
        [checked] = st.checker.check_round(wave.server_round, [msg],
                                           lambda m: (key, wave.node_of[key]), [key],
                                           wave.material)
        row = client_row(0, checked, wave.downlink[key], st._dense_update_nbytes)
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
                           dense_only=st.downlink.mode != "auto",
                           config_digest=wave.config_digest)

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
        applied = st._aggregate(step, replies, replies, by_key, scale)
        if not applied:
            for b in taken:
                b.row.status, b.row.reason = "rejected", "aggregate was not finite"
        for row in self.rows:
            row.round = step
        record = round_record(step, self.rows, self.uplink_bytes, st._dense_update_nbytes,
                              st._dense_model_nbytes, st.model_version)
        st.records.client_rows.extend(self.rows)
        st.round_record = record
        self.rows, self.uplink_bytes = [], 0
        log(INFO, "async step %d: %d applied (staleness %s), model version %d", step,
            len(taken), [b.staleness for b in taken], st.model_version)
        return applied


def _innermost(grid: Grid) -> bool:
    """Whether ``grid`` is (or wraps) fedgc's in-process grid."""
    while not isinstance(grid, LocalGrid):
        inner = getattr(grid, "grid", None)
        if not isinstance(inner, Grid):
            return False
        grid = inner
    return True


def run_async(strategy: DGCStrategy, grid: Grid, initial_arrays: ArrayRecord,
              num_rounds: int, timeout: float, train_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
    """Run ``num_rounds`` applied steps of FedBuff on ``grid`` (module docstring): the
    asynchronous counterpart of :func:`server.loop.run_rounds`, with the same strategy,
    records and results.

    Raises
    ------
    SettingsError
        Under the network emulator (not wired to this loop yet), or with ``resume = true``
        (the dispatches in flight are not checkpointed yet).
    """
    if strategy.extensions:
        raise SettingsError("mode = async does not run under the network emulator (netem.*) "
                            "yet: its per-client timelines are not wired to the asynchronous "
                            "loop (docs/async.md)")
    if strategy.resume:
        raise SettingsError("mode = async cannot resume yet: the dispatches in flight are not "
                            "in the checkpoint (docs/async.md); run it again from the start")
    log(INFO, "Starting %s strategy, asynchronous (FedBuff):", strategy.__class__.__name__)
    strategy.summary()
    strategy.set_model(initial_arrays)
    loop = AsyncLoop(strategy, grid, timeout,
                     ConfigRecord() if train_config is None else train_config)
    result = Result()
    if evaluate_fn is not None:
        res = evaluate_fn(0, strategy.model_arrays())
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    started = time.time()
    for step in range(1, num_rounds + 1):
        while len(loop.buffer) < loop.buffer_size:
            loop.fill()
            if not loop.inflight:
                raise RuntimeError("no client could be dispatched: the registry sampled none")
            for dispatch, msg in loop.collect():
                loop.take(dispatch, msg)
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
        strategy.keep_round(record)
    result.arrays = strategy.model_arrays()
    return result
