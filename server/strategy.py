"""DGCStrategy: a Flower FedAvg that aggregates DGC-compressed sparse pseudo-gradients.

One round, each step in its own module:

1. ``configure_train``: the registry (:mod:`server.registry`) identifies and samples clients;
   the downlink (:mod:`server.downlink`) gives each the dense model or a patch on what it holds;
2. ``aggregate_train``: the extensions (:mod:`server.extensions`) say which replies arrived;
   :mod:`server.replies` decodes and validates each into an accepted update or a rejection with
   its reason; an extension may select which of them the round takes; :mod:`server.records`
   turns them into client rows; :mod:`server.defences` bounds each client's weight and norm;
   :mod:`server.aggregation` averages the accepted ones in O(total nonzeros);
   :mod:`fedgc.methods.optimizer` takes the server step; the downlink moves to the next
   version; the registry records acks and held versions;
3. ``start`` (:mod:`server.loop`): evaluate, checkpoint (:mod:`server.checkpoint`), go on.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

import dgc
from dgc import SparseUpdate
from dgc.wire import encoded_size
from fedgc import protocol as P
from fedgc.keys import ServerSettings
from fedgc.methods import Channel, Method, ServerOptimizer, material_of
from fedgc.schema import fields_of
from fedgc.settings import RunConfig
from server.aggregation import Combine
from server.async_loop import run_async
from server.checkpoint import (
    STRATEGY_STATE_VERSION,
    CheckpointError,
    check_run_config,
    migrate_strategy_state,
    save_checkpoint,
)
from server.defences import Bounds, left_out_note
from server.downlink import Downlink
from server.extensions import (
    Reply,
    RoundExtension,
    Selection,
    apply_extensions,
    arrived,
    selector_of,
)
from server.loop import run_rounds
from server.privacy import PrivateRound
from server.records import (
    ClientRow,
    RoundRecord,
    RoundRows,
    RunRecords,
    round_record,
    train_metrics,
)
from server.registry import ClientRegistry, RoundOutcome
from server.replies import CheckedReply, ReplyChecker, ReplyRejected
from server.robust import RootUpdate

__all__ = ["ClientRow", "DGCStrategy", "ReplyRejected", "RoundRecord"]


@dataclass
class _Round:
    """What configure_train sent in the round being run."""

    server_round: int
    sampled: list[int]  # client keys, in sampling order
    node_of: dict[int, int]  # client key -> node id
    version_sent: int
    config_digest: str = ""  # digest of the run config the messages named
    downlink: dict[int, tuple[str, int]] = field(default_factory=dict)  # key -> (kind, bytes)
    material: Any = None  # the method's round material sent (DGC: the shared index sets)
    # Client key -> its train message's metadata (not the message: no model held past the round).
    sent: dict[int, Metadata] = field(default_factory=dict)

    def sender(self, msg: Message, registry: ClientRegistry) -> tuple[int, int]:
        """(client key, node id) of a reply (key -1: none of ours)."""
        if msg.has_error():
            # An error may come from the SuperLink itself, in place of a node it declared
            # offline, under its own node id: the message it answers names the client.
            wanted = msg.metadata.reply_to_message_id
            for key, sent in self.sent.items():
                if wanted and sent.message_id == wanted:
                    return key, self.node_of[key]
        return registry.key_of(msg.metadata.src_node_id), msg.metadata.src_node_id


class DGCStrategy(FedAvg):
    """Federated Averaging of compressed pseudo-gradients: Deep Gradient Compression (Lin et
    al., ICLR 2018) and every other :class:`fedgc.methods.Method`.

    Clients reply with their method's encoded pseudo-gradient ``global - local`` (see
    :mod:`client.app`). With dense updates, ``server_lr = 1`` and no momentum it computes
    exactly Flower's FedAvg. Every setting is a run key, documented and checked once by the
    settings engine (``fedgc.settings``, ``python -m simulations keys``).

    Parameters
    ----------
    settings : RunConfig
        The run's keys (default: every key's default). ``checkpoint`` writes
        ``<run_dir>/checkpoint.pt`` after every round; a resume that changes a key that matters
        is refused, naming it (:func:`server.checkpoint.check_run_config`).
    method : fedgc.methods.Method, optional
        The run's method (default: ``settings.method``, the one its ``method`` key names).
    on_round : callable, optional
        Called with each finished :class:`RoundRecord` (progress display, results files).
    extensions : sequence of server.extensions.RoundExtension
        Hooks into every round (:mod:`server.extensions`): keys added to the train messages,
        which replies a round takes, columns added to the results (the network emulator's
        virtual clock, drops, wire bytes and joules).
    """

    def __init__(self, settings: RunConfig | None = None, method: Method | None = None, *,
                 on_round: Callable[[RoundRecord], None] | None = None,
                 extensions: Sequence[RoundExtension] = ()) -> None:
        settings = RunConfig() if settings is None else settings
        s, t = settings.server, settings.train
        super().__init__(fraction_train=1.0, fraction_evaluate=s.fraction_evaluate,
                         min_train_nodes=t.clients_per_round,
                         min_available_nodes=t.clients_per_round,
                         arrayrecord_key=P.ARRAYS, configrecord_key=P.CONFIG)
        self.settings = settings
        self.method = settings.method if method is None else method
        self.clients_per_round, self.over_selection = t.clients_per_round, s.over_selection
        self.checkpoint_dir = settings.run_dir if s.checkpoint else None
        self.resume, self.on_round, self.probe_timeout = s.resume, on_round, s.round_timeout_s
        self.extensions = list(extensions)
        #: Secure aggregation and DP (server.privacy), None when the run uses neither; also
        #: an extension (its columns, summary and state).
        self.privacy = (PrivateRound(t, self.method, s.round_timeout_s)
                        if t.privacy_secagg or t.privacy_dp != "off" else None)
        if self.privacy is not None:
            self.extensions.append(self.privacy)
            self.privacy.extensions = self.extensions
        self.selector = selector_of(self.extensions)
        self.registry = ClientRegistry(t.seed, [0] if s.clients_build_initial_model else [])
        policy = self.method.downlink(settings)
        self.downlink = Downlink(s.downlink, s.downlink_history, policy.density, policy.values,
                                 s.downlink_deltas, s.downlink_deadband, s.downlink_vectors,
                                 s.downlink_context, s.downlink_compact)
        self.downlink_lookahead = s.downlink_lookahead
        self.optimizer = (self.method.optimizer(settings)
                          or ServerOptimizer(s.server_lr, s.server_momentum))
        self.aggregator = self.method.aggregator(settings)
        self.checker = ReplyChecker(self.method, self.method.codec(t), self.weighted_by_key)
        self.bounds = Bounds(s.max_weight_ratio, s.max_norm_ratio)
        self.root_update = RootUpdate(settings) if s.aggregation == "fltrust" else None
        self.combine = Combine(s.aggregation, s.trim_fraction, s.clip_radius, s.clip_iterations,
                               root=self._root, min_cosine=s.min_cosine,
                               bucket_size=s.bucket_size, seed=t.seed,
                               gate_reference=s.gate_reference, gate_memory=s.gate_memory,
                               clean_radius=s.clip_radius_clean,
                               memory_below=s.gate_memory_below,
                               first_bar=s.gate_first_bar)
        self.channel: Channel | None = None  # the method's round material, from set_model
        self.records = RunRecords()
        self.completed_rounds = 0
        self.round_record = RoundRecord(0)  # the last aggregated round's, until start() keeps it
        self._round: _Round | None = None
        self._dense_update_nbytes = self._dense_model_nbytes = 0
        #: The asynchronous loop's dispatches in flight at the last applied step
        #: (:meth:`server.async_loop.AsyncLoop.state_dict`): in the checkpoint, so that a
        #: resumed asynchronous run sends them again. None in a synchronous run.
        self.async_state: dict[str, Any] | None = None

    @property
    def run_config(self) -> dict[str, Any]:
        """The keys a checkpoint keeps and a resume must match: the run's, and the
        extensions'."""
        out = self.settings.to_flat()
        for ext in self.extensions:
            out.update(ext.run_config())
        return out

    def summary(self) -> None:
        """Log the strategy's settings: the method and every server key."""
        for line in filter(None, (ext.describe() for ext in self.extensions)):
            log(INFO, "\t├──> %s", line)
        log(INFO, "\t├──> DGCStrategy settings (method %s):", self.method.title)
        keys = {f.metadata["key"] for f in fields_of(ServerSettings)}
        for key, value in sorted(self.settings.to_flat().items()):
            if key in keys or key == "clients_per_round":
                log(INFO, "\t│\t├── %s = %s", key, value)
        super().summary()

    # ------------------------------------------------------------------ the model
    @property
    def model(self) -> OrderedDict[str, torch.Tensor] | None:
        """The global model (float32), None before the first round."""
        return self.downlink.model

    @property
    def model_version(self) -> int:
        """Aggregations applied so far: the version of the model clients are sent."""
        return self.downlink.version

    @property
    def sent_model(self) -> OrderedDict[str, torch.Tensor]:
        """The model clients are sent and hold."""
        return self.downlink.sent_model

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor shapes of the global model, by name."""
        assert self.model is not None
        return {k: tuple(v.shape) for k, v in self.model.items()}

    def set_model(self, arrays: ArrayRecord) -> None:
        """Adopt ``arrays`` as version 0 of the global model (float tensors only)."""
        model: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, t in arrays.to_torch_state_dict().items():
            if not t.is_floating_point():
                raise ValueError(f"model tensor {name!r} has dtype {t.dtype}; DGCStrategy "
                                 f"trains floating-point tensors only")
            model[name] = t.detach().to(torch.float32).clone().contiguous()
        self.downlink.reset(model)
        self._model_changed()
        part = material_of(self.method)
        if self.channel is None and part is not None:
            self.channel = part.channel(self.settings, self.shapes)
        if self.channel is not None:
            self.channel.hold(self.sent_model, 0, self.downlink.initial_on_grid)

    def _model_changed(self) -> None:
        self.checker.expect(self.shapes)
        for ext in self.extensions:
            ext.set_model(self.shapes)
        # What a dense fp32 update costs on the same wire, and what the dense model costs as
        # Flower ArrayRecord: the baselines of the compression ratios.
        self._dense_update_nbytes = encoded_size(SparseUpdate.from_dense(self.model, "float32"))
        self._dense_model_nbytes = P.record_nbytes(self.model_arrays())

    @property
    def dense_update_nbytes(self) -> int:
        """What a dense fp32 update of the model costs on the wire: the uplink's baseline."""
        return self._dense_update_nbytes

    @property
    def dense_model_nbytes(self) -> int:
        """What the dense model costs as a Flower ArrayRecord: the downlink's baseline."""
        return self._dense_model_nbytes

    @property
    def dense_downlink_only(self) -> bool:
        """Whether clients are always sent the dense model (no patches): the registry then
        records no held versions."""
        return self.downlink.mode != "auto"

    def model_arrays(self) -> ArrayRecord:
        """The global model as an ArrayRecord (one numpy Array per tensor)."""
        assert self.model is not None
        return ArrayRecord(OrderedDict((k, v.clone()) for k, v in self.model.items()))

    def apply(self, updates: list[SparseUpdate], weights: list[float],
              total_weight: float | None = None) -> bool:
        """One server step on the weighted average of ``updates`` (divided by ``total_weight``,
        default the sum of ``weights``); False, the model unchanged, if it is not finite."""
        total = float(sum(weights)) if total_weight is None else float(total_weight)
        return self.step(self.combine.average(updates, weights, total, self.shapes))

    def step(self, avg: Mapping[str, torch.Tensor]) -> bool:
        """One server step on the round's aggregate ``avg``; False, the model unchanged, if it
        is not finite."""
        assert self.model is not None
        new = self.optimizer.step(self.model, avg)
        if new is None:
            return False
        self.downlink.advance(new, new if self.downlink.broadcast is None
                              else self.optimizer.heading(new, self.downlink_lookahead))
        if self.channel is not None:
            self.channel.observe(avg)
        return True

    # ------------------------------------------------------------------ a round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample clients and send each the model (dense or patch) with its acknowledgement,
        and the run's ``config`` whole only to a client not known to hold it (its digest
        otherwise: :mod:`fedgc.protocol`)."""
        self._step(server_round, "configure", True)
        messages = self._configure(server_round, arrays, config, grid)
        self._step(server_round, "configure", False)
        return messages

    def _configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                   grid: Grid) -> list[Message]:
        if self.model is None:
            self.set_model(arrays)
        reg = self.registry
        node_of, connected = reg.sample_round(
            grid, server_round, math.ceil(self.clients_per_round * self.over_selection),
            max(self.min_available_nodes, self.clients_per_round), self.probe_timeout)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_of), connected)
        self._round, messages = self.train_messages(server_round, node_of, config, grid)
        return messages

    def train_messages(self, server_round: int, node_of: dict[int, int], config: ConfigRecord,
                       grid: Grid | None = None) -> tuple[_Round, list[Message]]:
        """The train messages of ``server_round`` for the clients ``node_of`` names (client key
        -> node id, in sampling order), and what was sent: the model (dense or patch), its
        acknowledgement, the round material (the asynchronous loop sends one per dispatch).
        Under secure aggregation its first stages run on ``grid`` first (a sync round's; the
        asynchronous loop runs without privacy)."""
        reg = self.registry
        sampled = list(node_of)
        digest = P.config_digest(config)
        state = _Round(server_round, sampled, node_of, self.model_version, digest)
        shared_record, shared_nbytes = None, 0
        if self.channel is not None:
            self.channel.hold(self.sent_model, self.model_version, self.downlink.initial_on_grid)
        planned = self.channel.plan(server_round) if self.channel is not None else None
        if planned is not None:
            data, state.material = planned
            shared_record, shared_nbytes = P.bytes_to_record(data, P.SHARED_MASK), len(data)
        offers = self.downlink.offers(reg.held(key) for key in sampled)
        stage2: dict[int, bytes] | None = None
        if self.privacy is not None and self.privacy.secagg:
            assert grid is not None, "secure aggregation's stages need the round's grid"
            layout = self.privacy.layout_of(self.aggregator.space(self.shapes), state.material,
                                            server_round)
            stage2 = self.privacy.open(grid, server_round, node_of, layout)
        messages = []
        for key in sampled:
            if stage2 is not None and key not in stage2:
                state.downlink[key] = ("none", 0)  # out of the secure session: sent nothing
                continue
            offer = offers[reg.held(key)]
            cfg = ConfigRecord({P.CONFIG_DIGEST: digest})
            cfg[P.SERVER_ROUND] = server_round
            cfg[P.MODEL_VERSION] = self.model_version
            cfg[P.ACK_SEQUENCE] = reg.acked(key)
            for k, v in self.downlink.config(offer, reg.initial_versions).items():
                cfg[k] = v
            for ext in self.extensions:
                for k, v in ext.message_keys(server_round, key).items():
                    cfg[k] = v
            content = RecordDict({P.ARRAYS: offer.record, P.CONFIG: cfg})
            if not reg.holds_config(key, digest):
                content[P.RUN_CONFIG] = ConfigRecord(dict(config))
            if shared_record is not None:
                content[P.SHARED] = shared_record
            if stage2 is not None:
                content[P.SECAGG] = P.bytes_to_record(stage2[key], P.SECAGG)
            state.downlink[key] = (offer.kind, offer.nbytes + shared_nbytes)
            # The round as group id, as Flower's own strategies set it: SuperNodes log it.
            message = Message(content, dst_node_id=node_of[key],
                              message_type=MessageType.TRAIN, group_id=str(server_round))
            state.sent[key] = message.metadata
            messages.append(message)
        return state, messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies that arrived, take what the round takes (every reply, or what
        the selecting extension says), aggregate the valid ones sparsely, apply the server
        optimizer."""
        self._step(server_round, "aggregate", True)
        state = self._current(server_round)
        came = [Reply(msg, state.sender(msg, self.registry)[0]) for msg in replies]
        checked = self.check_replies(server_round, [r.message for r in
                                                    arrived(self.extensions, server_round, came)])
        chosen = None if self.selector is None else self.selector.select(server_round, checked)
        if chosen is None:
            chosen = Selection(tuple(checked))
        out = self.aggregate_checked(server_round, chosen.taken, chosen.processed)
        self._step(server_round, "aggregate", False)
        return out

    def check_replies(self, server_round: int, replies: Iterable[Message]) -> list[CheckedReply]:
        """Every reply of the round, decoded (in one batch) and checked once, in order."""
        state = self._current(server_round)
        if self.privacy is not None and self.privacy.secagg:
            return self.privacy.check_round(replies, lambda msg: state.sender(msg, self.registry),
                                            state.sampled, self.weighted_by_key)
        return self.checker.check_round(server_round, replies,
                                        lambda msg: state.sender(msg, self.registry),
                                        state.sampled, state.material)

    def aggregate_checked(self, server_round: int, checked: Iterable[CheckedReply],
                          processed: Iterable[int] = ()
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the first ``clients_per_round`` valid replies of ``checked`` in sampling
        order; sampled clients without a reply among them timed out.

        ``processed``: clients known to hold this round's model although their reply is not
        in ``checked`` (:class:`server.extensions.Selection`): their next patch builds on it.
        """
        state = self._current(server_round)
        taken = RoundRows(server_round, state.sampled, state.node_of, state.downlink,
                          self._dense_update_nbytes, self.records)
        for reply in checked:
            taken.take(reply)
        chosen, rows, valid = taken.close(self.clients_per_round), taken.rows, taken.valid
        applied = bool(chosen) and self._aggregate(server_round, [valid[k] for k in chosen],
                                                   list(valid.values()), rows)
        if chosen and not applied:
            why = (self.privacy.failure if self.privacy is not None and self.privacy.failure
                   else "aggregate was not finite")
            for k in chosen:
                rows[k].status, rows[k].reason = "rejected", why
        self.registry.settle(server_round,
                             [RoundOutcome(k, r.status, r.reason) for k, r in rows.items()],
                             version_sent=state.version_sent, processed=processed,
                             dense_only=self.downlink.mode != "auto",
                             config_digest=state.config_digest)
        ordered = taken.ordered()
        self.records.client_rows.extend(ordered)
        record = round_record(server_round, ordered, taken.uplink_bytes, self._dense_update_nbytes,
                              self._dense_model_nbytes, self.model_version)
        apply_extensions(self.extensions, record, ordered)
        self.round_record = record
        log(INFO, "aggregate_train: %d aggregated, %d rejected, %d failed; uplink %d B",
            record.clients_aggregated, record.clients_rejected, record.clients_failed,
            record.uplink_bytes)
        return (self.model_arrays() if applied else None), MetricRecord(train_metrics(record))

    def aggregate_buffer(self, step: int, replies: list[CheckedReply],
                         rows: Mapping[int, ClientRow], scale: Sequence[float]) -> bool:
        """The asynchronous loop's step on its buffer (:mod:`server.async_loop`): the same
        defences, aggregator and server step as a round's, each reply's update scaled by its
        staleness weight after the defences; whether the step was finite."""
        return self._aggregate(step, replies, replies, rows, scale)

    def _aggregate(self, server_round: int, chosen: list[CheckedReply],
                   valid: list[CheckedReply], rows: Mapping[int, ClientRow],
                   scale: Sequence[float] | None = None) -> bool:
        """Defences, combine, the method's aggregator, the server step (module docstring),
        noting a bounded client in its row; whether the step was finite.

        ``scale``: a factor per reply of ``chosen`` applied to its update after the defences
        (the asynchronous loop's staleness weight: ``sum(w * s * u) / sum(w)``, FedBuff's)."""
        factor = list(scale) if scale is not None else [1.0] * len(chosen)
        # A fixed order: a reproducible sum (sorted() is stable: one client's replies keep
        # theirs).
        order = sorted(range(len(chosen)), key=lambda i: chosen[i].client_key)
        chosen, factor = [chosen[i] for i in order], [factor[i] for i in order]
        if self.privacy is not None:  # mode = async is refused with privacy: no scale here
            return self._aggregate_private(server_round, chosen)
        weights, factors, notes = self.bounds.apply(chosen, valid)
        factors = [f * g for f, g in zip(factors, factor, strict=True)]
        for key, note in notes.items():
            rows[key].reason = note
            log(WARNING, "\t> Client %d: %s", key, note)
        if not self.aggregator.weighted:
            weights = [1.0] * len(chosen)
        space = self.aggregator.space(self.shapes)
        try:
            combined = self.combine([c.payload for c in chosen], weights, factors, space,
                                    client_keys=[c.client_key for c in chosen])
        except dgc.AggregationError as ex:
            log(WARNING, "\t> Round %d aggregation failed, model unchanged: %s", server_round, ex)
            return False
        for i, cos in self.combine.left_out.items():
            # Rejected, not aggregated: the client's method folds its update back next round.
            row = rows[chosen[i].client_key]
            row.status, row.reason = "rejected", left_out_note(
                cos, self.combine.min_cosine, self.combine.gate_reference,
                self.combine.record.get(chosen[i].client_key) if i in self.combine.held_out
                else None)
            log(WARNING, "\t> Client %d: %s", chosen[i].client_key, row.reason)
        return self.step(self.aggregator.finish(combined, self.shapes))

    def _aggregate_private(self, server_round: int, chosen: list[CheckedReply]) -> bool:
        """The round's aggregate under secure aggregation or central DP (server.privacy):
        every client counts once; whether the step was finite."""
        assert self.privacy is not None
        space = self.aggregator.space(self.shapes)
        self.privacy.noise_round(server_round)
        if self.privacy.secagg:
            combined = self.privacy.secure_mean(chosen, space)
            if combined is None:
                return False
        elif self.method.sets_only(self.settings.train):  # central DP at the sets only
            assert self._round is not None
            layout = self.privacy.layout_of(space, self._round.material, server_round)
            combined = self.privacy.layout_mean([c.payload for c in chosen], layout)
        else:
            payloads = [c.payload for c in chosen]
            try:
                mean = self.combine(payloads, [1.0] * len(chosen),
                                    self.privacy.clip_factors(payloads), space)
            except dgc.AggregationError as ex:
                log(WARNING, "\t> Round %d aggregation failed, model unchanged: %s",
                    server_round, ex)
                return False
            combined = self.privacy.noisy_mean(mean, len(chosen))
        if not self.privacy.secagg and self.privacy.adaptive is not None:
            self.privacy.adapt_clip(self.privacy.bits_of(chosen))
        return self.step(self.aggregator.finish(combined, self.shapes))

    def _step(self, server_round: int, name: str, begins: bool) -> None:
        for ext in self.extensions:
            ext.step(server_round, name, begins)

    def _root(self, space: Mapping[str, tuple[int, ...]]) -> torch.Tensor:
        """FLTrust's root update: the server's own round on its root set, from the model
        clients were sent this round."""
        assert self.root_update is not None and self._round is not None
        return self.root_update(self.sent_model, self._round.server_round, space)

    def _current(self, server_round: int) -> _Round:
        if self._round is None or self._round.server_round != server_round or self.model is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for "
                               f"that round")
        return self._round

    # ------------------------------------------------------------------ state
    @property
    def rounds(self) -> list[RoundRecord]:
        """The finished rounds."""
        return self.records.rounds

    @property
    def client_rows(self) -> list[ClientRow]:
        """What happened to each sampled client, round after round."""
        return self.records.client_rows

    @property
    def rejections(self) -> dict[str, int]:
        """Refused replies by reason."""
        return self.records.rejections

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run: model, optimizer, clients, records."""
        return {"strategy_state_version": STRATEGY_STATE_VERSION,
                "completed_rounds": self.completed_rounds, "run_config": self.run_config,
                **self.downlink.state_dict(),
                **self.optimizer.state_dict(), **self.registry.state_dict(),
                **self.records.state_dict(), "combine": self.combine.state_dict(),
                "method": {"aggregator": self.aggregator.state_dict(),
                           "channel": None if self.channel is None
                           else self.channel.state_dict()},
                "extensions": [ext.state_dict() for ext in self.extensions],
                **({} if self.async_state is None else {"async_loop": self.async_state})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a refused state (another configuration, model or
        downlink) raises CheckpointError and changes nothing."""
        state = migrate_strategy_state(dict(state))
        check_run_config(state.get("run_config"), self.run_config)
        if self.model is not None:
            theirs = {k: tuple(v.shape) for k, v in state["model"].items()}
            if self.shapes != theirs:
                raise CheckpointError(f"checkpoint model {theirs} does not match the run's "
                                      f"model {self.shapes}")
        self.downlink.check_state(state)
        self.downlink.load_state_dict(state)
        self._model_changed()
        self.completed_rounds = int(state["completed_rounds"])
        self.optimizer.load_state_dict(state)
        self.registry.load_state_dict(state)
        self.records.load_state_dict(state)
        self.aggregator.load_state_dict(state["method"]["aggregator"])
        self.combine.load_state_dict(state.get("combine", {}))  # none before issue 26
        if self.channel is not None and state["method"]["channel"] is not None:
            self.channel.load_state_dict(state["method"]["channel"])
        for ext, ext_state in zip(self.extensions, state.get("extensions", []), strict=False):
            ext.load_state_dict(ext_state)
        self.async_state = state.get("async_loop")

    def keep_round(self, record: RoundRecord) -> None:
        """Keep a finished, evaluated round: records, checkpoint, then ``on_round``."""
        self.rounds.append(record)
        self.completed_rounds = record.round
        if self.checkpoint_dir is not None:
            save_checkpoint(self.checkpoint_dir, self.state_dict())
        if self.on_round is not None:
            self.on_round(record)

    # ------------------------------------------------------------------ the loop
    # Flower 1.42's Strategy.start always runs rounds 1..num_rounds from ``initial_arrays`` and
    # has no hook after a round: resuming after round k and a checkpoint per round need a loop
    # of our own (server.loop).
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """Run rounds ``completed_rounds + 1 .. num_rounds`` (:func:`server.loop.run_rounds`).

        ``evaluate_fn`` is expected to return a MetricRecord with ``accuracy`` (a fraction) and
        ``loss``; they fill :class:`RoundRecord`.
        """
        if evaluate_fn is not None and self.extensions:
            evaluate = evaluate_fn

            def stepped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                self._step(server_round, "evaluate", True)
                try:
                    return evaluate(server_round, arrays)
                finally:
                    self._step(server_round, "evaluate", False)

            evaluate_fn = stepped
        if self.settings.server.mode == "async":
            return run_async(self, grid, initial_arrays, num_rounds, timeout, train_config,
                             evaluate_fn)
        return run_rounds(self, grid, initial_arrays, num_rounds, timeout, train_config,
                          evaluate_config, evaluate_fn)
