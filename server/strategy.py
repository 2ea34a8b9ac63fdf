"""DGCStrategy: a Flower FedAvg that aggregates DGC-compressed sparse pseudo-gradients.

One round, each step in its own module:

1. ``configure_train``: the registry (:mod:`server.registry`) identifies and samples clients;
   the downlink (:mod:`server.downlink`) gives each the dense model or a patch on what it holds;
2. ``aggregate_train``: :mod:`server.replies` decodes and validates each reply into an accepted
   update or a rejection with its reason; :mod:`server.records` turns them into client rows;
   :mod:`server.defences` bounds each client's weight and norm; :mod:`server.aggregation`
   averages the accepted ones in O(total nonzeros); :mod:`server.optimizer` takes the server
   step; the downlink moves to the next version; the registry records acks and held versions;
3. ``start`` (:mod:`server.loop`): evaluate, checkpoint (:mod:`server.checkpoint`), go on.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
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
from dgc.signs.codec import Masks, encode_mask
from dgc.signs.planner import SharedIndexPlanner, displacement_masks
from dgc.wire import encoded_size
from fedgc import protocol as P
from fedgc.settings import (
    AGGREGATIONS,
    DENSE_METHODS,
    SERVER_MOMENTUM_METHODS,
    RunConfig,
    ServerSettings,
    TrainSettings,
)
from server.aggregation import ROBUST, SparseAverage, robust_average
from server.checkpoint import (
    STRATEGY_STATE_VERSION,
    CheckpointError,
    check_run_config,
    migrate_strategy_state,
    save_checkpoint,
)
from server.defences import Bounds
from server.downlink import Downlink
from server.loop import run_rounds
from server.optimizer import ServerOptimizer
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

__all__ = ["ClientRow", "DGCStrategy", "ReplyRejected", "RoundRecord"]


@dataclass
class _Round:
    """What configure_train sent in the round being run."""

    server_round: int
    sampled: list[int]  # client keys, in sampling order
    node_of: dict[int, int]  # client key -> node id
    version_sent: int
    downlink: dict[int, tuple[str, int]] = field(default_factory=dict)  # key -> (kind, bytes)
    masks: Masks = field(default_factory=dict)  # the shared index sets sent
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
    """Federated Averaging of Deep Gradient Compression updates (Lin et al., ICLR 2018).

    Clients reply with ``dgc.encode``-d pseudo-gradients ``global - local`` (see
    :mod:`client.app`). With dense updates, ``server_learning_rate = 1`` and no momentum it
    computes exactly Flower's FedAvg. Values are checked once, by the settings engine
    (``fedgc.settings``); :meth:`from_settings` builds the strategy of a run config.

    Parameters
    ----------
    clients_per_round : int (default: 10)
        Clients whose updates are aggregated each round.
    over_selection : float (default: 1.0)
        Sample ``ceil(clients_per_round * over_selection)`` clients and aggregate the first
        ``clients_per_round`` valid replies in sampling order (straggler defence); the others
        are "surplus": not acknowledged, so those clients restore their update.
    server_learning_rate, server_momentum : float (default: 1.0, 0.0)
        The server optimizer (:class:`server.optimizer.ServerOptimizer`, FedAvgM's convention).
    downlink : {"auto", "dense"} (default: "auto")
        "auto" sends a client a patch valid on every version it may hold when none is more than
        ``downlink_history`` versions old and the patch is smaller than the dense model.
    downlink_history : int (default: 1)
        The most versions a patch may span.
    downlink_density : float (default: 1.0)
        Below 1: clients hold a broadcast model that follows the global model by this fraction
        of its matrix entries each round, those that differ most, rounded to ``downlink_values``
        (float16 or int8 grid); what is not sent stays in the difference (error feedback).
    downlink_values : {"float16", "int8", "ternary"} (default: "float16")
        The grid of the compressed broadcast's matrix entries; "ternary": per tensor, the
        entries sent move by sign * their mean difference (STC's downlink, Sattler et al. 2019).
    downlink_deltas : bool (default: True)
        With int8: version 0 is on the grid too, and a patch on one known version carries
        differences where those encode smaller.
    downlink_lookahead : float (default: 1.0)
        With server momentum: the broadcast follows ``G - a * lr * m * buf`` (Nesterov's
        look-ahead) instead of ``G``; 0 follows ``G``.
    clients_build_initial_model : bool (default: False)
        Clients build version 0 themselves, so a first message may be a patch on version 0.
    seed : int (default: 0)
        Seed of client sampling.
    checkpoint_dir : str or Path, optional (default: None)
        Where to write ``checkpoint.pt`` after every round. None: no checkpoints.
    resume : bool (default: False)
        Continue from ``checkpoint_dir``'s checkpoint in :meth:`start` (an error without one).
    max_weight_ratio, max_norm_ratio : float (default: 4.0, 10.0)
        A client's weight is capped at, and its update clipped to, this times the round's
        median (:class:`server.defences.Bounds`; 0 turns a bound off).
    aggregation : {"mean", "trimmed_mean", "median"} (default: "mean")
        "mean": the weighted mean (FedAvg). The others, for users who want them: the
        coordinate-wise trimmed mean (``trim_fraction`` of the clients cut at each end) or
        median, unweighted (:func:`server.aggregation.robust_average`). A sparse update's
        unsent entries count as zeros, so at low density these move the model far less.
    trim_fraction : float (default: 0.1)
        The fraction of a round's clients the trimmed mean cuts at each end, in [0, 0.5).
    run_config : mapping, optional (default: None)
        The run's configuration keys (``RunConfig.to_flat()``), kept with every checkpoint: a
        resume that changes one that matters is refused, naming it
        (:func:`server.checkpoint.check_run_config`).
    on_round : callable, optional (default: None)
        Called with each finished :class:`RoundRecord` (progress display, results files).
    probe_timeout : float (default: 120.0)
        Seconds to wait for the query replies that identify new nodes.
    fraction_evaluate, min_evaluate_nodes, min_available_nodes, weighted_by_key
        As in Flower's FedAvg (defaults 0.0, 2, 2, "num-examples").
    shared_density, shared_small_density, shared_small_numel, shared_momentum : optional
        The shared-index sign channel (:mod:`dgc.signs`; defaults 0.0 = off, 0.0, 10000, 0.9).
    min_sparse_numel, sparse_vectors : int, bool (default: 1024, False)
        Tensors smaller than ``min_sparse_numel``, and 1-D ones unless ``sparse_vectors``, are
        sent dense and get no shared set (:meth:`dgc.DGCConfig.sends_dense`).
    """

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(self, clients_per_round: int = 10, over_selection: float = 1.0,
                 server_learning_rate: float = 1.0, server_momentum: float = 0.0,
                 downlink: str = "auto", downlink_history: int = 1, downlink_density: float = 1.0,
                 downlink_values: str = "float16", downlink_deltas: bool = True,
                 downlink_lookahead: float = 1.0, downlink_deadband: float = 0.5,
                 downlink_vectors: str = "float32",
                 clients_build_initial_model: bool = False,
                 seed: int = 0, checkpoint_dir: str | Path | None = None, resume: bool = False,
                 on_round: Callable[[RoundRecord], None] | None = None,
                 probe_timeout: float = 120.0, fraction_evaluate: float = 0.0,
                 min_evaluate_nodes: int = 2, min_available_nodes: int = 2,
                 weighted_by_key: str = "num-examples", shared_density: float = 0.0,
                 shared_small_density: float = 0.0, shared_small_numel: int = 10_000,
                 shared_momentum: float = 0.9, shared_churn: float = 1.0,
                 shared_rank: str = "aggregates",
                 min_sparse_numel: int = 1024,
                 sparse_vectors: bool = False,
                 max_weight_ratio: float = 4.0, max_norm_ratio: float = 10.0,
                 aggregation: str = "mean", trim_fraction: float = 0.1,
                 run_config: Mapping[str, bool | int | float | str] | None = None) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=clients_per_round, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=P.ARRAYS, configrecord_key=P.CONFIG)
        # The settings engine checks every value (its SettingsError names the key).
        ServerSettings(over_selection=over_selection, server_lr=server_learning_rate,
                       server_momentum=server_momentum, downlink=downlink,
                       downlink_history=downlink_history, downlink_density=downlink_density,
                       downlink_values=downlink_values, downlink_deltas=downlink_deltas,
                       downlink_lookahead=downlink_lookahead,
                       downlink_deadband=downlink_deadband, downlink_vectors=downlink_vectors,
                       shared_churn=shared_churn,
                       shared_rank=shared_rank,
                       fraction_evaluate=fraction_evaluate,
                       round_timeout_s=probe_timeout, shared_density=shared_density,
                       shared_small_density=shared_small_density, shared_momentum=shared_momentum)
        policy = TrainSettings(clients_per_round=clients_per_round, small_numel=shared_small_numel,
                               min_sparse_numel=min_sparse_numel,
                               sparse_vectors=sparse_vectors).dgc_config()
        self.clients_per_round, self.over_selection = clients_per_round, float(over_selection)
        self.downlink_lookahead = float(downlink_lookahead)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.resume, self.on_round, self.probe_timeout = resume, on_round, probe_timeout
        self.run_config = None if run_config is None else dict(run_config)
        self.shared = (float(shared_density), shared_small_density, shared_small_numel,
                       shared_momentum, policy)
        self.shared_churn, self.shared_rank = float(shared_churn), shared_rank
        self._initial_sent: dict[str, torch.Tensor] = {}  # version 0 as clients hold it
        self.registry = ClientRegistry(seed, [0] if clients_build_initial_model else [])
        self.downlink = Downlink(downlink, downlink_history, downlink_density, downlink_values,
                                 downlink_deltas, downlink_deadband, downlink_vectors)
        self.optimizer = ServerOptimizer(server_learning_rate, server_momentum)
        self.checker = ReplyChecker(weighted_by_key)
        self.bounds = Bounds(max_weight_ratio, max_norm_ratio)
        # Not run config keys yet: checked here until the settings engine has them.
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got "
                             f"{aggregation!r}")
        if not (isinstance(trim_fraction, (int, float)) and 0 <= trim_fraction < 0.5):
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}")
        self.aggregation, self.trim_fraction = aggregation, float(trim_fraction)
        self.records = RunRecords()
        self.shared_planner: SharedIndexPlanner | None = None
        self.completed_rounds = 0
        self.round_record = RoundRecord(0)  # the last aggregated round's, until start() keeps it
        self._round: _Round | None = None
        self._average = SparseAverage()
        self._dense_update_nbytes = self._dense_model_nbytes = 0

    @classmethod
    def from_settings(cls, config: RunConfig, **hooks: Any) -> DGCStrategy:
        """The strategy of a validated run config; ``hooks`` add ``on_round`` and the like."""
        return cls(**cls.arguments(config), **hooks)

    @staticmethod
    def arguments(config: RunConfig) -> dict[str, Any]:
        """The constructor's keyword arguments for a validated run config."""
        s, t = config.server, config.train
        # Dense FedAvg (and FedAvgM) is the baseline: it always broadcasts the exact model. STC
        # compresses its downlink at its own density, ternary (STC's "updown").
        downlink_density, downlink_values = s.downlink_density, s.downlink_values
        if t.method in DENSE_METHODS:
            downlink_density = 1.0
        elif t.method == "stc":
            downlink_density, downlink_values = s.stc_downlink_density, "ternary"
        return dict(
            clients_per_round=t.clients_per_round, over_selection=s.over_selection,
            # FedAvgM is dense FedAvg with DGC's server optimizer: DGC's gain over it is the
            # compression's alone.
            server_learning_rate=(s.dgc_server_lr if t.method in SERVER_MOMENTUM_METHODS
                                  else s.server_lr),
            server_momentum=(s.dgc_server_momentum if t.method in SERVER_MOMENTUM_METHODS
                             else s.server_momentum),
            downlink=s.downlink, downlink_history=s.downlink_history,
            downlink_density=downlink_density,
            downlink_values=downlink_values, downlink_deltas=s.downlink_deltas,
            downlink_lookahead=s.downlink_lookahead, downlink_deadband=s.downlink_deadband,
            downlink_vectors=s.downlink_vectors,
            shared_churn=s.shared_churn, shared_rank=s.shared_rank,
            clients_build_initial_model=s.clients_build_initial_model, seed=t.seed,
            checkpoint_dir=config.run_dir if s.checkpoint else None, resume=s.resume,
            fraction_evaluate=s.fraction_evaluate, min_available_nodes=t.clients_per_round,
            # Node identification happens in round 1, with Ray's start-up: the round's time.
            probe_timeout=s.round_timeout_s,
            # The sign channel needs a residual to send from: DGC only.
            shared_density=s.shared_density if t.method == "dgc" else 0.0,
            shared_small_density=s.shared_small_density, shared_small_numel=t.small_numel,
            shared_momentum=s.shared_momentum, min_sparse_numel=t.min_sparse_numel,
            sparse_vectors=t.sparse_vectors,
            max_weight_ratio=s.max_weight_ratio, max_norm_ratio=s.max_norm_ratio,
            aggregation=s.aggregation, trim_fraction=s.trim_fraction,
            run_config=config.to_flat())

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        d, o = self.downlink, self.optimizer
        log(INFO, "\t├──> DGCStrategy settings:")
        log(INFO, "\t│\t├── Clients per round: %d (over-selection %.2f)",
            self.clients_per_round, self.over_selection)
        log(INFO, "\t│\t├── Server learning rate: %s", o.learning_rate)
        log(INFO, "\t│\t├── Server momentum: %s", o.momentum)
        log(INFO, "\t│\t├── Downlink: %s (history %d, density %g%s%s)", d.mode, d.history,
            d.density, f", {d.values} values" if d.density < 1.0 else "",
            ", clients build version 0" if self.registry.initial_versions else "")
        log(INFO, "\t│\t├── Shared sign channel: %s", "off" if not self.shared[0] else
            f"density {self.shared[0]:g} (small tensors {self.shared[1]:g}), "
            f"momentum {self.shared[3]:g}")
        log(INFO, "\t│\t├── Sampling seed: %d", self.registry.seed)
        log(INFO, "\t│\t└── Checkpoints: %s%s", self.checkpoint_dir or "off",
            " (resume)" if self.resume else "")
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
        self._initial_sent = {k: v.clone() for k, v in self.downlink.sent_model.items()}
        self._model_changed()
        density, small, small_numel, momentum, policy = self.shared
        if density > 0 and self.shared_planner is None:
            self.shared_planner = SharedIndexPlanner(
                {n: tuple(t.shape) for n, t in model.items()
                 if not policy.sends_dense(tuple(t.shape))}, density, small, small_numel,
                momentum, self.shared_churn)

    def _model_changed(self) -> None:
        self.checker.expect(self.shapes)
        # What a dense fp32 update costs on the same wire, and what the dense model costs as
        # Flower ArrayRecord: the baselines of the compression ratios.
        self._dense_update_nbytes = encoded_size(SparseUpdate.from_dense(self.model, "float32"))
        self._dense_model_nbytes = P.record_nbytes(self.model_arrays())

    def model_arrays(self) -> ArrayRecord:
        """The global model as an ArrayRecord (one numpy Array per tensor)."""
        assert self.model is not None
        return ArrayRecord(OrderedDict((k, v.clone()) for k, v in self.model.items()))

    def apply(self, updates: list[SparseUpdate], weights: list[float],
              total_weight: float | None = None) -> bool:
        """One server step on the weighted average of ``updates`` (divided by ``total_weight``,
        default the sum of ``weights``); False, the model unchanged, if it is not finite."""
        total = float(sum(weights)) if total_weight is None else float(total_weight)
        return self.step(self._average(updates, weights, total, self.shapes))

    def step(self, avg: Mapping[str, torch.Tensor]) -> bool:
        """One server step on the round's aggregate ``avg``; False, the model unchanged, if it
        is not finite."""
        assert self.model is not None
        new = self.optimizer.step(self.model, avg)
        if new is None:
            return False
        self.downlink.advance(new, new if self.downlink.broadcast is None
                              else self.optimizer.heading(new, self.downlink_lookahead))
        if self.shared_planner is not None:
            self.shared_planner.observe(avg)
        return True

    # ------------------------------------------------------------------ a round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample clients and send each the model (dense or patch) with its acknowledgement."""
        if self.model is None:
            self.set_model(arrays)
        reg = self.registry
        node_of, connected = reg.sample_round(
            grid, server_round, math.ceil(self.clients_per_round * self.over_selection),
            max(self.min_available_nodes, self.clients_per_round), self.probe_timeout)
        sampled = list(node_of)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(sampled), connected)
        state = _Round(server_round, sampled, node_of, self.model_version)
        shared_record, shared_nbytes = None, 0
        shared_config: dict[str, Any] = {}
        if self.shared_planner is not None and self.shared_rank == "displacement":
            if self.model_version > 0:  # version 0 has not moved: no set in the first round
                counts = {n: self.shared_planner.count(n) for n in self.shared_planner.shapes}
                state.masks = displacement_masks(self.sent_model, self._initial_sent, counts)
                shared_config = {P.SHARED_NAMES: list(counts),
                                 P.SHARED_COUNTS: [int(c) for c in counts.values()],
                                 P.INITIAL_GRID: self.downlink.initial_on_grid}
        elif self.shared_planner is not None:
            state.masks = self.shared_planner.plan()
            if state.masks:
                data = encode_mask(state.masks, {n: self.model[n].numel() for n in state.masks},
                                   server_round)
                shared_record, shared_nbytes = P.bytes_to_record(data, P.SHARED_MASK), len(data)
        offers = self.downlink.offers(reg.held(key) for key in sampled)
        messages = []
        for key in sampled:
            offer = offers[reg.held(key)]
            cfg = ConfigRecord(dict(config))
            cfg[P.SERVER_ROUND] = server_round
            cfg[P.MODEL_VERSION] = self.model_version
            cfg[P.ACK_SEQUENCE] = reg.acked(key)
            for k, v in {**self.downlink.config(offer, reg.initial_versions),
                         **shared_config}.items():
                cfg[k] = v
            content = RecordDict({P.ARRAYS: offer.record, P.CONFIG: cfg})
            if shared_record is not None:
                content[P.SHARED] = shared_record
            state.downlink[key] = (offer.kind, offer.nbytes + shared_nbytes)
            # The round as group id, as Flower's own strategies set it: SuperNodes log it.
            message = Message(content, dst_node_id=node_of[key],
                              message_type=MessageType.TRAIN, group_id=str(server_round))
            state.sent[key] = message.metadata
            messages.append(message)
        self._round = state
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, aggregate the valid ones sparsely, apply the server optimizer."""
        return self.aggregate_checked(server_round, self.check_replies(server_round, replies))

    def check_replies(self, server_round: int, replies: Iterable[Message]) -> list[CheckedReply]:
        """Every reply of the round, decoded (in one batch) and checked once.

        Extension point: a subclass that must know which replies are valid before it
        aggregates (the network emulator) calls this, then :meth:`aggregate_checked`.
        """
        state = self._current(server_round)
        return self.checker.check_round(server_round, replies,
                                        lambda msg: state.sender(msg, self.registry),
                                        state.sampled, state.masks)

    def aggregate_checked(self, server_round: int, checked: Iterable[CheckedReply],
                          processed: Iterable[int] = ()
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the first ``clients_per_round`` valid replies of ``checked`` in sampling
        order; sampled clients without a reply among them timed out.

        ``processed``: clients known to hold this round's model although their reply is not
        in ``checked`` (the network emulator's late replies): their next patch builds on it.
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
            for k in chosen:
                rows[k].status, rows[k].reason = "rejected", "aggregate was not finite"
        self.registry.settle(server_round, [RoundOutcome(k, r.status) for k, r in rows.items()],
                             version_sent=state.version_sent, processed=processed,
                             dense_only=self.downlink.mode != "auto")
        ordered = taken.ordered()
        self.records.client_rows.extend(ordered)
        record = round_record(server_round, ordered, taken.uplink_bytes, self._dense_update_nbytes,
                              self._dense_model_nbytes, self.model_version)
        self.close_round(record, ordered)
        self.round_record = record
        log(INFO, "aggregate_train: %d aggregated, %d rejected, %d failed; uplink %d B",
            record.clients_aggregated, record.clients_rejected, record.clients_failed,
            record.uplink_bytes)
        return (self.model_arrays() if applied else None), MetricRecord(train_metrics(record))

    def close_round(self, record: RoundRecord, rows: list[ClientRow]) -> None:
        """Extension point: amend the round's record and client rows before they are kept
        (the network emulator marks its drops and virtual time). Does nothing here."""

    def _aggregate(self, server_round: int, chosen: list[CheckedReply],
                   valid: list[CheckedReply], rows: Mapping[int, ClientRow]) -> bool:
        """Apply the weighted average of ``chosen`` (and their signs) within the bounds, noting
        a bounded client in its row; whether it was finite."""
        chosen = sorted(chosen, key=lambda c: c.client_key)  # a fixed order: a reproducible sum
        weights, factors, notes = self.bounds.apply(chosen, valid)
        for key, note in notes.items():
            rows[key].reason = note
            log(WARNING, "\t> Client %d: %s", key, note)
        # A client's signs (dgc.signs) are one more sparse update with its weight.
        signed = [i for i, c in enumerate(chosen) if c.signs is not None]
        scaled = [w * f for w, f in zip(weights, factors, strict=True)]
        if self.aggregation in ROBUST:
            return self.step(robust_average(
                [[c.update] + ([c.signs] if c.signs is not None else []) for c in chosen],
                factors, self.aggregation, self.trim_fraction, self.shapes))
        try:
            return self.apply([c.update for c in chosen] + [chosen[i].signs for i in signed],
                              scaled + [scaled[i] for i in signed], total_weight=sum(weights))
        except dgc.AggregationError as ex:
            log(WARNING, "\t> Round %d aggregation failed, model unchanged: %s", server_round, ex)
            return False

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
                **self.records.state_dict(),
                "shared_planner": (None if self.shared_planner is None
                                   else self.shared_planner.state_dict())}

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
        if self.shared_planner is not None and state.get("shared_planner") is not None:
            self.shared_planner.load_state_dict(state["shared_planner"])

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
        return run_rounds(self, grid, initial_arrays, num_rounds, timeout, train_config,
                          evaluate_config, evaluate_fn)
