"""DGCStrategy: a Flower FedAvg that aggregates DGC-compressed sparse pseudo-gradients.

Per round (``configure_train`` then ``aggregate_train``):

1. identify clients by a stable key (a query message once per node: node ids change with every
   simulation run, partition ids do not), and sample them with a seeded generator;
2. send each the dense broadcast model, or a patch valid on every version it may hold,
   whichever is smaller, with ``ack_sequence``: the sequence of its last update that was
   aggregated. The broadcast model is the global model itself, or, with ``downlink_density <
   1``, a copy that follows it by the largest entries of their difference each round (a
   compressed broadcast with server-side error feedback). With ``shared_density > 0`` the
   message also carries the round's shared index sets (:mod:`dgc.shared`), at which every
   client sends its residual as scaled signs;
3. decode and validate every reply; a rejected reply is logged with its reason, counted, and
   never touches the model;
4. aggregate by scatter-add in O(total nonzeros), weighted by ``num-examples``, and apply the
   server optimizer ``buf = m*buf + avg; global -= lr * buf``;
5. record bytes, failures and timings per round and per client, evaluate (``evaluate_fn``) and
   checkpoint atomically.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
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
from client import protocol as P
from dgc import DecodeError, SparseTensor, SparseUpdate, TensorLayout
from dgc.grid import grid_exponent, initial_exponents, to_int8_grid
from dgc.shared import Masks, SharedIndexPlanner, decode_signs, encode_mask
from dgc.wire import encoded_size
from server.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from server.config import DOWNLINK_VALUES

STRATEGY_STATE_VERSION = 1

#: The most bytes of past grid values the server keeps for delta patches (``downlink_deltas``);
#: a patch on a version beyond them carries values.
DELTA_HISTORY_BYTES = 256 * 2**20


@dataclass
class ClientRow:
    """What happened to one sampled client in one round (one line of ``clients.csv``)."""

    round: int
    client_key: int
    node_id: int
    status: str  # aggregated | rejected | error | timeout | surplus
    reason: str = ""
    downlink: str = ""
    downlink_bytes: int = 0
    uplink_bytes: int = 0
    nnz: int = 0
    density: float = 0.0
    compression_ratio: float = 0.0
    num_examples: int = 0
    train_loss: float = float("nan")
    compute_seconds: float = 0.0
    restored: int = 0
    ray_node: str = ""  # the Ray node that ran the round, as its reply names it (client.node)


@dataclass
class RoundRecord:
    """One round's totals (one line of ``rounds.csv``). Accuracy is a fraction in [0, 1]."""

    round: int
    accuracy: float = float("nan")
    loss: float = float("nan")
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    dense_uplink_bytes: int = 0
    dense_downlink_bytes: int = 0
    clients_sampled: int = 0
    clients_aggregated: int = 0
    clients_failed: int = 0
    clients_rejected: int = 0
    patches_sent: int = 0
    nnz: int = 0
    train_loss: float = float("nan")
    compute_seconds_max: float = 0.0
    wall_seconds: float = 0.0
    model_version: int = 0
    # Filled by the network emulator (simulations.netem.strategy.NetemStrategy); 0 without it.
    virtual_seconds: float = 0.0
    dropped_deadline: int = 0
    dropped_link: int = 0
    dropped_rejected: int = 0


@dataclass
class _RoundState:
    server_round: int
    sampled: list[int]  # client keys, in sampling order
    node_of: dict[int, int]  # client key -> node id
    downlink: dict[int, tuple[str, int]]  # client key -> (kind, bytes)
    version_sent: int
    rows: list[ClientRow] = field(default_factory=list)
    masks: Masks = field(default_factory=dict)  # the shared index sets sent this round
    signs: dict[int, SparseUpdate] = field(default_factory=dict)  # client key -> its signs
    # Client key -> its train message's metadata (not the message: no model held past the round).
    sent: dict[int, Metadata] = field(default_factory=dict)
    # id(reply) -> (reply, validate_reply's result or its ReplyRejected, the reply's signs): each
    # reply is decoded and validated once per round, however many times it is asked about.
    validated: dict[int, tuple[Message, Any, SparseUpdate | None]] = field(default_factory=dict)

    def key_of_reply(self, msg: Message) -> int | None:
        """The client key whose train message ``msg`` answers (None when it answers none).

        The grid gives each message its id when it pushes it, so this is read at reply time.
        """
        wanted = msg.metadata.reply_to_message_id
        return next((key for key, sent in self.sent.items()
                     if wanted and sent.message_id == wanted), None)


class ReplyRejected(ValueError):
    """A train reply failed validation; the message names the reason."""


def _float16_grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest float16 values, in float32 (values beyond float16's range
    unrounded)."""
    rounded = t.to(torch.float16).to(torch.float32)
    return torch.where(torch.isfinite(rounded), rounded, t)


# pylint: disable=too-many-instance-attributes
class DGCStrategy(FedAvg):
    """Federated Averaging of Deep Gradient Compression updates (Lin et al., ICLR 2018).

    Clients reply with ``dgc.encode``-d pseudo-gradients ``global - local`` (see
    :mod:`client.app`); the strategy validates, aggregates them sparsely and applies a server
    optimizer. With dense updates, ``server_learning_rate = 1`` and no momentum it computes
    exactly Flower's FedAvg.

    Parameters
    ----------
    clients_per_round : int (default: 10)
        Clients whose updates are aggregated each round.
    over_selection : float (default: 1.0)
        Sample ``ceil(clients_per_round * over_selection)`` clients and aggregate the first
        ``clients_per_round`` valid replies in sampling order (straggler defence, 1.3 is usual).
        The others are "surplus": not acknowledged, so those clients restore their update.
    server_learning_rate : float (default: 1.0)
        Server step size on the averaged pseudo-gradient.
    server_momentum : float (default: 0.0)
        Server momentum, in the convention of Flower's FedAvgM and ``torch.optim.SGD``.
    downlink : {"auto", "dense"} (default: "auto")
        "auto" sends a client a patch valid on every version it may hold (what it held and, when
        its reply did not arrive, what it was last sent) when none is more than
        ``downlink_history`` versions old and the encoded patch is smaller than the dense
        model; "dense" always sends the dense model.
    downlink_history : int (default: 1)
        The most versions a patch may span: a client that holds an older version gets the
        dense model. The server keeps, per entry, the version at which it last changed (one
        int32 per parameter whatever this value), not past models.
    downlink_density : float (default: 1.0)
        1: clients are sent the global model exactly. Below 1: the server keeps a *broadcast
        model* that clients hold and train from; after each aggregation it copies into it the
        ``ceil(downlink_density * n)`` entries of the global model, over all tensors of two or
        more dims (n entries in all), where the two differ most (one-dimensional tensors are
        copied whole). What is not sent stays in the difference and is sent in later rounds
        (error feedback on the server, as in DoubleSqueeze, Tang et al. 2019). The broadcast
        model then changes in few entries per round, so patches stay small. The copied matrix
        entries are rounded to float16, so patches carry them in two bytes (the rounding stays
        in the difference, like any entry not sent).
    downlink_values : {"float16", "int8"} (default: "float16")
        The grid the compressed broadcast's matrix entries are rounded to (with
        ``downlink_density < 1``). "int8": per tensor a power-of-two step ``2**e``, the finest
        with ``127 * 2**e >= 8 * max |entry|`` of the initial model; patches carry one signed
        byte per entry or fewer bits, Rice-coded (``dgc.encode(grid_coding=True)``). When the
        global model outgrows the range the step doubles and the whole tensor is sent again on
        the new grid (rare: it doubles).
    downlink_deltas : bool (default: True)
        With ``downlink_values="int8"``: version 0 is broadcast on the grid too
        (:func:`dgc.grid.round_initial`), and a patch to a client whose version the server
        knows exactly (one base version) carries, per grid tensor where that encodes smaller,
        the differences from that version (``patch_add``: the client adds them) instead of the
        values. Differences of grid values are small multiples of the step, so they take fewer
        Rice-coded bits. The server keeps the changed entries of past versions to compute them
        (at most ``downlink_history`` versions and :data:`DELTA_HISTORY_BYTES`; checkpointed).
    downlink_lookahead : float (default: 1.0)
        With ``downlink_density < 1`` and server momentum: the broadcast follows where the
        global model is heading, ``G - downlink_lookahead * server_learning_rate *
        server_momentum * buf`` (the part of the next step the momentum buffer already fixes,
        Nesterov's look-ahead), instead of ``G``. Clients hold a model that lags ``G`` by
        what has not been sent; the look-ahead offsets that lag (in the netem runs it wins
        back the rounds the compressed broadcast cost, docs/netem.md). 0: follow ``G``.
    clients_build_initial_model : bool (default: False)
        Clients build version 0 of the model themselves (the app ships it: the same seeded
        ``task.build_model()`` as the server's), so a client's first message may be a patch on
        version 0 instead of the dense model.
    seed : int (default: 0)
        Seed of client sampling (per round: ``Random(seed * 1000003 + round)``).
    checkpoint_dir : str or Path, optional (default: None)
        Where to write ``checkpoint.pt`` after every round. None: no checkpoints.
    resume : bool (default: False)
        Continue from ``checkpoint_dir``'s checkpoint in :meth:`start`, if there is one.
    on_round : callable, optional (default: None)
        Called with each finished :class:`RoundRecord` (progress display, results files).
    probe_timeout : float (default: 120.0)
        Seconds to wait for the query replies that identify new nodes.
    fraction_evaluate : float (default: 0.0)
        Fraction of nodes for federated evaluation; centralized evaluation (``evaluate_fn``)
        runs every round regardless.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes for federated evaluation.
    min_available_nodes : int (default: 2)
        Minimum number of connected nodes before a round starts.
    weighted_by_key : str (default: "num-examples")
        The reply metric that weighs each update.
    shared_density : float (default: 0.0)
        Shared-index sign channel (:mod:`dgc.shared`): the fraction of each sparsified tensor
        in the round's shared index set, at which every client sends its residual as scaled
        signs (1 bit per entry). 0 turns it off (FedAvg-equal behaviour for dense replies).
    shared_small_density : float (default: 0.0)
        The same fraction for sparsified tensors of at most ``shared_small_numel`` entries;
        0 uses ``shared_density``.
    shared_small_numel : int (default: 10000)
        Size limit of those small tensors.
    shared_momentum : float (default: 0.9)
        Factor of the moving average of aggregates that ranks the shared indices.
    min_sparse_numel : int (default: 1024)
        Tensors smaller than this, and 1-D ones, are sent dense by clients and get no shared set.
    """

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(
        self,
        clients_per_round: int = 10,
        over_selection: float = 1.0,
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.0,
        downlink: str = "auto",
        downlink_history: int = 1,
        downlink_density: float = 1.0,
        downlink_values: str = "float16",
        downlink_deltas: bool = True,
        downlink_lookahead: float = 1.0,
        clients_build_initial_model: bool = False,
        seed: int = 0,
        checkpoint_dir: str | Path | None = None,
        resume: bool = False,
        on_round: Callable[[RoundRecord], None] | None = None,
        probe_timeout: float = 120.0,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        shared_density: float = 0.0,
        shared_small_density: float = 0.0,
        shared_small_numel: int = 10_000,
        shared_momentum: float = 0.9,
        min_sparse_numel: int = 1024,
    ) -> None:
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=clients_per_round,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=P.ARRAYS,
            configrecord_key=P.CONFIG,
        )
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int) \
                or clients_per_round < 1:
            raise ValueError(f"clients_per_round must be an integer >= 1, got "
                             f"{clients_per_round!r}")
        if not (isinstance(over_selection, (int, float)) and 1.0 <= over_selection <= 10.0):
            raise ValueError(f"over_selection must be in [1, 10], got {over_selection!r}")
        if not (isinstance(server_learning_rate, (int, float)) and server_learning_rate > 0
                and math.isfinite(server_learning_rate)):
            raise ValueError(f"server_learning_rate must be a finite number > 0, got "
                             f"{server_learning_rate!r}")
        if not (isinstance(server_momentum, (int, float)) and 0.0 <= server_momentum < 1.0):
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum!r}")
        if downlink not in ("auto", "dense"):
            raise ValueError(f"downlink must be 'auto' or 'dense', got {downlink!r}")
        if isinstance(downlink_history, bool) or not isinstance(downlink_history, int) \
                or downlink_history < 0:
            raise ValueError(f"downlink_history must be an integer >= 0, got "
                             f"{downlink_history!r}")
        self.clients_per_round = clients_per_round
        self.over_selection = float(over_selection)
        self.server_learning_rate = float(server_learning_rate)
        self.server_momentum = float(server_momentum)
        if isinstance(downlink_density, bool) or not isinstance(downlink_density, (int, float)) \
                or not 0.0 < downlink_density <= 1.0:
            raise ValueError(f"downlink_density must be in (0, 1], got {downlink_density!r}")
        if downlink_values not in DOWNLINK_VALUES:
            raise ValueError(f"downlink_values must be one of {DOWNLINK_VALUES}, got "
                             f"{downlink_values!r}")
        self.downlink = downlink
        self.downlink_history = downlink_history
        self.downlink_density = float(downlink_density)
        self.downlink_values = downlink_values
        if not isinstance(downlink_deltas, bool):
            raise ValueError(f"downlink_deltas must be a bool, got {downlink_deltas!r}")
        self.downlink_deltas = downlink_deltas
        if isinstance(downlink_lookahead, bool) or not isinstance(
                downlink_lookahead, (int, float)) or not 0.0 <= downlink_lookahead <= 1.0:
            raise ValueError(f"downlink_lookahead must be in [0, 1], got {downlink_lookahead!r}")
        self.downlink_lookahead = float(downlink_lookahead)
        # With deltas: per version u, per grid tensor, the entries that changed at u and their
        # values before (what a patch on an older version subtracts). Oldest first.
        self._history: OrderedDict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = \
            OrderedDict()
        self._history_nbytes = 0
        # downlink_values "int8": per matrix, the exponent e of the broadcast's grid step 2**e
        # (None while the tensor is all zeros: any grid holds it).
        self.grid_exponents: dict[str, int | None] = {}
        # What the server assumes a client it never heard from holds.
        self.initial_versions = [0] if clients_build_initial_model else []
        self.seed = int(seed)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.resume = resume
        self.on_round = on_round
        self.probe_timeout = probe_timeout
        if not (isinstance(shared_density, (int, float)) and 0.0 <= shared_density <= 1.0):
            raise ValueError(f"shared_density must be in [0, 1], got {shared_density!r}")
        self.shared_density = float(shared_density)
        self.shared_small_density = shared_small_density
        self.shared_small_numel = shared_small_numel
        self.shared_momentum = shared_momentum
        self.min_sparse_numel = min_sparse_numel
        self.shared_planner: SharedIndexPlanner | None = None

        self.model: OrderedDict[str, torch.Tensor] | None = None  # the global model, float32
        # What clients hold, with downlink_density < 1 (None: they hold self.model).
        self.broadcast: OrderedDict[str, torch.Tensor] | None = None
        self.model_version = 0  # aggregations applied so far = version of the broadcast model
        self.completed_rounds = 0
        self.momentum_buffer: dict[str, torch.Tensor] | None = None
        # Per entry of the sent model, the version at which it last changed (patches are built
        # from it: an entry that changed after the oldest version a client may hold).
        self.changed_at: dict[str, torch.Tensor] = {}
        # key -> {"acked": seq, "versions": [versions the client may hold]}
        self.clients: dict[int, dict[str, Any]] = {}
        self.node_keys: dict[int, int] = {}  # node id -> client key (this process only)
        self.rounds: list[RoundRecord] = []
        self.client_rows: list[ClientRow] = []
        self.rejections: dict[str, int] = {}
        self._round: _RoundState | None = None
        # Clients known to have processed this round's message although their reply is not
        # among those aggregate_train was given (the network emulator's late replies).
        self._processed: set[int] = set()
        self._pending_record = RoundRecord(0)
        self._dense_update_nbytes = 0
        self._dense_model_nbytes = 0
        self._max_numel = 0
        self._checked_layouts: set[TensorLayout] = set()  # update layouts that match the model
        self._aggregate_out: dict[str, torch.Tensor] | None = None  # reused across rounds

    # ------------------------------------------------------------------ settings / model
    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        log(INFO, "\t├──> DGCStrategy settings:")
        log(INFO, "\t│\t├── Clients per round: %d (over-selection %.2f)",
            self.clients_per_round, self.over_selection)
        log(INFO, "\t│\t├── Server learning rate: %s", self.server_learning_rate)
        log(INFO, "\t│\t├── Server momentum: %s", self.server_momentum)
        log(INFO, "\t│\t├── Downlink: %s (history %d, density %g%s%s)", self.downlink,
            self.downlink_history, self.downlink_density,
            f", {self.downlink_values} values" if self.downlink_density < 1.0 else "",
            ", clients build version 0" if self.initial_versions else "")
        log(INFO, "\t│\t├── Shared sign channel: %s", "off" if not self.shared_density else
            f"density {self.shared_density:g} (small tensors {self.shared_small_density:g}), "
            f"momentum {self.shared_momentum:g}")
        log(INFO, "\t│\t├── Sampling seed: %d", self.seed)
        log(INFO, "\t│\t└── Checkpoints: %s%s", self.checkpoint_dir or "off",
            " (resume)" if self.resume else "")
        super().summary()

    def set_model(self, arrays: ArrayRecord) -> None:
        """Adopt ``arrays`` as the global model (float tensors only are trained and sent)."""
        state = arrays.to_torch_state_dict()
        model: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, t in state.items():
            if not t.is_floating_point():
                raise ValueError(f"model tensor {name!r} has dtype {t.dtype}; DGCStrategy "
                                 f"trains floating-point tensors only")
            model[name] = t.detach().to(torch.float32).clone().contiguous()
        self.model = model
        self.broadcast = self._copy(model) if self.downlink_density < 1.0 else None
        self.grid_exponents = {}
        if self.downlink_density < 1.0 and self.downlink_values == "int8":
            self.grid_exponents = initial_exponents(model)
            if self.downlink_deltas:
                # Version 0 on the grid too, so that every version differs from every other by
                # multiples of the step (clients that build it round it the same way).
                for k, e in self.grid_exponents.items():
                    if e is not None:
                        self.broadcast[k] = to_int8_grid(model[k], e)
        self._forget_history()
        self.changed_at = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in model.items()}
        self._measure_dense()
        if self.shared_density > 0 and self.shared_planner is None:
            self.shared_planner = SharedIndexPlanner(
                {n: tuple(t.shape) for n, t in model.items()
                 if t.dim() > 1 and t.numel() >= self.min_sparse_numel},
                self.shared_density, self.shared_small_density, self.shared_small_numel,
                self.shared_momentum)

    @property
    def initial_on_grid(self) -> bool:
        """Whether version 0 of the broadcast is rounded to the int8 grid (deltas on)."""
        return bool(self.grid_exponents) and self.downlink_deltas

    def _forget_history(self) -> None:
        self._history = OrderedDict()
        self._history_nbytes = 0

    def _remember(self, version: int, changed: Mapping[str, torch.Tensor],
                  before: Mapping[str, torch.Tensor]) -> None:
        """Keep the grid entries that changed at ``version`` (``changed``: a mask per tensor)
        with their values ``before``."""
        changes = {}
        for name in self.grid_exponents:
            idx = torch.nonzero(changed[name].view(-1)).view(-1)
            if idx.numel():
                changes[name] = (idx, before[name].view(-1)[idx].clone())
        self._history[version] = changes
        self._history_nbytes += _history_nbytes(changes)
        while self._history and (next(iter(self._history)) <= version - self.downlink_history
                                 or self._history_nbytes > DELTA_HISTORY_BYTES):
            _, dropped = self._history.popitem(last=False)
            self._history_nbytes -= _history_nbytes(dropped)

    def _grid_values_at(self, version: int) -> dict[str, torch.Tensor] | None:
        """The grid tensors of the sent model as they were at ``version``, or None when the
        kept history does not reach back to it."""
        if not all(u in self._history for u in range(version + 1, self.model_version + 1)):
            return None
        out = {name: self.sent_model[name].clone() for name in self.grid_exponents}
        for u in range(self.model_version, version, -1):  # newest first: the oldest value wins
            for name, (idx, old) in self._history[u].items():
                out[name].view(-1)[idx] = old
        return out

    def _measure_dense(self) -> None:
        assert self.model is not None
        # What a dense fp32 update costs on the same wire, and what the dense model costs as
        # Flower ArrayRecord: the baselines of the compression ratios.
        self._dense_update_nbytes = encoded_size(SparseUpdate.from_dense(self.model, "float32"))
        self._max_numel = max((t.numel() for t in self.model.values()), default=0)
        self._checked_layouts = set()  # checked against the previous model's shapes
        self._dense_model_nbytes = P.record_nbytes(self.model_arrays())

    def model_arrays(self) -> ArrayRecord:
        """The global model as an ArrayRecord (one numpy Array per tensor)."""
        assert self.model is not None
        return ArrayRecord(OrderedDict((k, v.clone()) for k, v in self.model.items()))

    @property
    def sent_model(self) -> OrderedDict[str, torch.Tensor]:
        """The model clients are sent and hold: the broadcast model, or the global model."""
        assert self.model is not None
        return self.broadcast if self.broadcast is not None else self.model

    @staticmethod
    def _copy(model: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
        return OrderedDict((k, v.clone()) for k, v in model.items())

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor shapes of the global model, by name."""
        assert self.model is not None
        return {k: tuple(v.shape) for k, v in self.model.items()}

    def register_clients(self, node_keys: Mapping[int, int]) -> None:
        """Record node id -> client key pairs (what the identification query learns)."""
        for node, key in node_keys.items():
            self.node_keys.pop(int(node), None)  # re-registering moves the node to the newest
            self.node_keys[int(node)] = int(key)

    def nodes_by_key(self, node_ids: list[int]) -> dict[int, int]:
        """Client key -> the node to message, among the connected ``node_ids``.

        A SuperNode that crashed and came back has a new node id, while the SuperLink may still
        list the dead one as online for a while: when several connected nodes carry one key,
        the most recently identified one wins (``node_keys`` keeps identification order).
        """
        online = set(node_ids)
        node_of: dict[int, int] = {}
        for node, key in self.node_keys.items():
            if node in online:
                node_of[key] = node
        return node_of

    # ------------------------------------------------------------------ configure
    def _identify(self, grid: Grid, node_ids: list[int]) -> None:
        unknown = [n for n in node_ids if n not in self.node_keys]
        if not unknown:
            return
        messages = [Message(RecordDict({P.CONFIG: ConfigRecord({"ask": P.CLIENT_KEY})}),
                            dst_node_id=n, message_type=MessageType.QUERY) for n in unknown]
        replies = grid.send_and_receive(messages, timeout=self.probe_timeout)
        for msg in replies:
            if msg.has_error():
                log(WARNING, "node %d did not identify itself: %s", msg.metadata.src_node_id,
                    msg.error.reason)
                continue
            metrics = msg.content.metric_records.get(P.METRICS)
            if metrics is None or P.CLIENT_KEY not in metrics:
                log(WARNING, "node %d sent no client key", msg.metadata.src_node_id)
                continue
            self.node_keys[msg.metadata.src_node_id] = int(metrics[P.CLIENT_KEY])  # type: ignore
        missing = len([n for n in unknown if n not in self.node_keys])
        if missing:
            log(WARNING, "%d of %d new nodes are unidentified and will not be sampled", missing,
                len(unknown))

    def _wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        while len(node_ids := sorted(grid.get_node_ids())) < needed:
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).",
                len(node_ids), needed)
            time.sleep(1)
        return node_ids

    def sample(self, server_round: int, keys: list[int]) -> list[int]:
        """The client keys sampled in ``server_round`` (reproducible from the seed)."""
        want = min(len(keys), math.ceil(self.clients_per_round * self.over_selection))
        rng = random.Random(self.seed * 1_000_003 + server_round)
        return rng.sample(sorted(keys), want)

    def _patch(self, base_versions: tuple[int, ...]) -> tuple[bytes, list[str]] | None:
        """A patch that turns any of ``base_versions`` into the current sent model, and the
        tensors whose patch values are differences to add (``patch_add``) rather than values.

        It carries, with their current values, the entries that changed after the oldest base:
        on each base an entry outside that set already holds the current bits, so replacing the
        set gives the same model whichever base the client holds. None when a base is more
        than ``downlink_history`` versions old (or newer than the model). On a single base,
        with ``downlink_deltas``, a grid tensor carries ``now - base`` instead where that
        encodes smaller (the differences sit on the grid, and adding them gives ``now`` bit for
        bit: both are checked).
        """
        if not base_versions or any(
                not self.model_version - self.downlink_history <= v <= self.model_version
                for v in base_versions):
            return None
        oldest = min(base_versions)
        base = (self._grid_values_at(oldest)
                if self.initial_on_grid and len(base_versions) == 1 else None)
        tensors, added = {}, []
        for name, t in self.sent_model.items():
            idx = torch.nonzero(self.changed_at[name].view(-1) > oldest).view(-1)
            values = t.view(-1)[idx].clone()
            if name in self.grid_exponents:
                # on the tensor's int8 grid: the encoder's grid coding carries them
                delta = None if base is None else self._delta(name, idx, values,
                                                              base[name].view(-1)[idx])
                if delta is not None:
                    tensors[name] = delta
                    added.append(name)
                    continue
            elif torch.equal((half := values.to(torch.float16)).to(torch.float32), values):
                # Values float16 holds exactly (every matrix entry the compressed broadcast
                # wrote, see _follow) travel in half the bytes; the client's float32 copy of
                # them is still bit for bit.
                values = half
            tensors[name] = SparseTensor(idx, values, tuple(t.shape))
        return dgc.encode(SparseUpdate(tensors, self.model_version),
                          grid_coding=bool(self.grid_exponents)), added

    def _delta(self, name: str, idx: torch.Tensor, now: torch.Tensor,
               then: torch.Tensor) -> SparseTensor | None:
        """The entries ``idx`` of grid tensor ``name`` as differences ``now - then`` (those
        that differ), when adding them gives ``now`` bit for bit and they encode smaller."""
        delta = now - then
        keep = delta != 0  # an entry that changed and changed back needs nothing added
        if not torch.equal((then[keep] + delta[keep]).view(torch.int32),
                           now[keep].view(torch.int32)):
            return None
        shape = tuple(self.sent_model[name].shape)
        added = SparseTensor(idx[keep], delta[keep], shape)
        if encoded_size(SparseUpdate({name: added}), grid_coding=True) \
                >= encoded_size(SparseUpdate({name: SparseTensor(idx, now, shape)}),
                                grid_coding=True):
            return None
        return added

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each the model (dense or patch) with its acknowledgement."""
        if self.model is None:
            self.set_model(arrays)
        node_ids = self._wait_for_nodes(grid, max(self.min_available_nodes,
                                                  self.clients_per_round))
        self._identify(grid, node_ids)
        node_of = self.nodes_by_key(node_ids)
        sampled = self.sample(server_round, list(node_of))
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(sampled), len(node_ids))

        dense_record = ArrayRecord(self._copy(self.sent_model))
        dense_nbytes = P.record_nbytes(dense_record)
        patches: dict[tuple[int, ...], tuple[bytes, list[str]] | None] = {}
        state = _RoundState(server_round, sampled, {k: node_of[k] for k in sampled}, {},
                            self.model_version)
        shared_record, shared_nbytes = None, 0
        if self.shared_planner is not None:
            state.masks = self.shared_planner.plan()
            if state.masks:
                data = encode_mask(state.masks, {n: self.model[n].numel() for n in state.masks},
                                   server_round)
                shared_record, shared_nbytes = P.bytes_to_record(data, P.SHARED_MASK), len(data)
        messages = []
        for key in sampled:
            info = self.clients.get(key, {})
            held = tuple(sorted(info.get("versions", self.initial_versions)))
            record, kind, nbytes, added = dense_record, "dense", dense_nbytes, []
            if self.downlink == "auto" and held:
                if held not in patches:
                    patches[held] = self._patch(held)
                patch = patches[held]
                if patch is not None and len(patch[0]) < dense_nbytes:
                    record, kind, nbytes = P.bytes_to_record(patch[0], P.PATCH), "patch", \
                        len(patch[0])
                    added = patch[1]
            cfg = ConfigRecord(dict(config))
            cfg[P.SERVER_ROUND] = server_round
            cfg[P.MODEL_VERSION] = self.model_version
            cfg[P.ACK_SEQUENCE] = info.get("acked", -1)
            cfg[P.DOWNLINK] = kind
            cfg[P.KEEP_MODEL] = self.downlink == "auto"
            if kind == "patch":
                cfg[P.BASE_VERSION] = held[-1]
                cfg[P.BASE_VERSIONS] = list(held)
                if added:
                    cfg[P.PATCH_ADD] = added
            if self.initial_on_grid and self.initial_versions:
                cfg[P.INITIAL_GRID] = True
            content = RecordDict({P.ARRAYS: record, P.CONFIG: cfg})
            if shared_record is not None:
                content[P.SHARED] = shared_record
            state.downlink[key] = (kind, nbytes + shared_nbytes)
            # The round as group id, as Flower's own strategies set it: SuperNodes log it
            # ("[RUN r, ROUND n]") with every message they receive.
            message = Message(content, dst_node_id=node_of[key],
                              message_type=MessageType.TRAIN, group_id=str(server_round))
            state.sent[key] = message.metadata
            messages.append(message)
        self._round = state
        return messages

    # ------------------------------------------------------------------ validate
    def validate_reply(self, msg: Message, server_round: int,
                       decoded: SparseUpdate | DecodeError | None = None,
                       ) -> tuple[int, SparseUpdate, MetricRecord, int]:
        """(client key, update, metrics, uplink bytes) of a valid reply; ReplyRejected if not.

        A reply to a message with shared index sets may carry the client's signs (a client
        without the channel, such as the phone encoder, sends none); they are decoded against
        the sets sent and kept in the round state for :meth:`aggregate_train`.

        ``decoded``, if given, is what ``dgc.decode_many`` gave for this reply's update bytes
        (with this strategy's ``max_numel``): it stands in for decoding them here, so that
        :meth:`aggregate_train` can decode a round's replies in one call. The checks and their
        order are the same either way.
        """
        assert self._round is not None
        content = msg.content
        metrics = content.metric_records.get(P.METRICS)
        if metrics is None:
            raise ReplyRejected(f"no {P.METRICS!r} MetricRecord")
        arrays = content.array_records.get(P.UPDATE)
        if arrays is None:
            raise ReplyRejected(f"no {P.UPDATE!r} ArrayRecord")
        try:
            data = P.record_to_bytes(arrays, P.UPDATE)
        except ValueError as ex:
            raise ReplyRejected(str(ex)) from ex
        weight = metrics.get(self.weighted_by_key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight <= 0:
            raise ReplyRejected(f"{self.weighted_by_key} must be a finite number > 0, got "
                                f"{weight!r}")
        try:
            if isinstance(decoded, DecodeError):
                raise decoded
            # max_numel: a forged header cannot make the server allocate more than the model.
            update = decoded if decoded is not None else dgc.decode(data,
                                                                    max_numel=self._max_numel)
        except DecodeError as ex:
            raise ReplyRejected(f"undecodable update ({len(data)} bytes): {ex}") from ex
        if update.sequence != server_round:
            raise ReplyRejected(f"update sequence {update.sequence} is not the round "
                                f"{server_round}")
        shapes = self.shapes
        if update.packed is not None:
            # Straight from decode, whose checks cover indices and values: only the names and
            # shapes are left, once per layout (replies of one round share theirs).
            layout = update.packed.layout
            if layout not in self._checked_layouts:
                self._check_tensors(dict(zip(layout.names, layout.shapes, strict=True)), shapes)
                self._checked_layouts.add(layout)
        else:
            self._check_tensors({name: t.shape for name, t in update.tensors.items()}, shapes)
            for name, t in update.tensors.items():
                if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= t.numel):
                    raise ReplyRejected(f"tensor {name!r} has indices outside [0, {t.numel})")
                if not torch.isfinite(t.values).all():
                    raise ReplyRejected(f"tensor {name!r} carries NaN or Inf values")
        key = self.node_keys.get(msg.metadata.src_node_id, -1)
        nbytes = len(data)
        shared = content.array_records.get(P.SHARED)
        self._round.signs.pop(key, None)
        if shared is not None:
            if not self._round.masks:
                raise ReplyRejected("shared signs in reply to a round without shared index sets")
            try:
                signs_data = P.record_to_bytes(shared, P.SHARED_SIGNS)
                signs = decode_signs(signs_data, self._round.masks,
                                     {n: shapes[n] for n in self._round.masks})
            except (ValueError, DecodeError) as ex:
                raise ReplyRejected(f"undecodable shared signs: {ex}") from ex
            if signs.sequence != server_round:
                raise ReplyRejected(f"shared signs sequence {signs.sequence} is not the round "
                                    f"{server_round}")
            self._round.signs[key] = signs
            nbytes += len(signs_data)
        return key, update, metrics, nbytes

    def validate_replies(self, replies: Iterable[Message], server_round: int,
                         ) -> list[tuple[int, SparseUpdate, MetricRecord, int] | ReplyRejected]:
        """:meth:`validate_reply` of each reply, in order: its result or its ReplyRejected.

        The update bytes of the round's replies are decoded in one ``dgc.decode_many`` call, and
        every result is remembered for the round: :meth:`aggregate_train` reuses it for the same
        reply instead of decoding and checking it (and its signs) a second time. A subclass that
        must know which replies are valid before it aggregates (the network emulator) calls this.
        """
        replies = list(replies)
        assert self._round is not None
        decoded = self._decode_replies(replies, self._round.sampled)
        out: list[tuple[int, SparseUpdate, MetricRecord, int] | ReplyRejected] = []
        for msg in replies:
            try:
                out.append(self._validate_once(msg, server_round, decoded.get(id(msg))))
            except ReplyRejected as ex:
                out.append(ex)
        return out

    def _validate_once(self, msg: Message, server_round: int,
                       decoded: SparseUpdate | DecodeError | None,
                       ) -> tuple[int, SparseUpdate, MetricRecord, int]:
        """:meth:`validate_reply`, or its remembered result for this very reply this round.

        A remembered valid reply puts its signs back into the round state (another reply from
        the same node may have been validated since), so that what is aggregated is always the
        update and signs of one reply.
        """
        state = self._round
        assert state is not None
        memo = state.validated.get(id(msg))
        if memo is not None and memo[0] is msg:
            outcome, signs = memo[1], memo[2]
            if isinstance(outcome, ReplyRejected):
                raise ReplyRejected(str(outcome))
            state.signs.pop(outcome[0], None)
            if signs is not None:
                state.signs[outcome[0]] = signs
            return outcome
        try:
            outcome = self.validate_reply(msg, server_round, decoded)
        except ReplyRejected as ex:
            state.validated[id(msg)] = (msg, ex, None)
            raise
        state.validated[id(msg)] = (msg, outcome, state.signs.get(outcome[0]))
        return outcome

    @staticmethod
    def _check_tensors(sent: Mapping[str, tuple[int, ...]],
                       shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ReplyRejected unless the update's tensors are the model's, by name and shape."""
        missing = sorted(set(shapes) - set(sent))
        extra = sorted(set(sent) - set(shapes))
        if missing or extra:
            raise ReplyRejected(f"tensor names differ from the model: missing {missing}, "
                                f"unknown {extra}")
        for name, shape in sent.items():
            if shape != shapes[name]:
                raise ReplyRejected(f"tensor {name!r} has shape {shape}, the model has "
                                    f"{shapes[name]}")

    # ------------------------------------------------------------------ aggregate
    def aggregate_train(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, aggregate the valid ones sparsely, apply the server optimizer."""
        state = self._round
        if state is None or state.server_round != server_round or self.model is None:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for "
                               f"that round")
        replies = list(replies)
        decoded = self._decode_replies(replies, state.sampled)
        rows: dict[int, ClientRow] = {}
        valid: dict[int, tuple[SparseUpdate, MetricRecord]] = {}
        uplink = 0
        sampled = set(state.sampled)
        for msg in replies:
            node = msg.metadata.src_node_id
            key = self.node_keys.get(node, -1)
            if msg.has_error():
                # An error may come from the SuperLink itself, in place of a node it declared
                # offline (missed heartbeats), under its own node id: the message the error
                # answers names the client.
                answered = state.key_of_reply(msg)
                if answered is not None:
                    key, node = answered, state.node_of[answered]
            if key not in sampled or key in rows:
                self._count_rejection("reply from a node that was not sampled or replied twice")
                log(WARNING, "\t> Ignored reply from node %d (client %d): not sampled in round "
                    "%d or a duplicate", node, key, server_round)
                continue
            kind, down = state.downlink[key]
            row = ClientRow(server_round, key, node, "error", downlink=kind, downlink_bytes=down)
            rows[key] = row
            if msg.has_error():
                row.reason = msg.error.reason
                log(INFO, "\t> Received error in reply from node %d: %s", node, row.reason)
                continue
            where = msg.content.config_records.get(P.NODE)
            row.ray_node = str(where.get("ray_node", ""))[:64] if where is not None else ""
            try:
                _, update, metrics, nbytes = self._validate_once(msg, server_round,
                                                                 decoded.get(id(msg)))
            except ReplyRejected as ex:
                row.status, row.reason = "rejected", str(ex)
                nbytes = _payload_nbytes(msg)
                row.uplink_bytes = nbytes
                uplink += nbytes
                self._count_rejection(str(ex).split(":")[0])
                log(WARNING, "\t> Rejected reply from node %d (client %d): %s", node, key, ex)
                continue
            uplink += nbytes
            row.status = "valid"
            row.uplink_bytes = nbytes
            row.nnz, row.density = update.nnz, update.density
            row.compression_ratio = self._dense_update_nbytes / nbytes
            row.num_examples = int(metrics[self.weighted_by_key])  # type: ignore[arg-type]
            row.train_loss = float(metrics.get("train_loss", float("nan")))  # type: ignore
            row.compute_seconds = float(metrics.get("compute_seconds", 0.0))  # type: ignore
            row.restored = int(metrics.get("restored", 0))  # type: ignore[arg-type]
            valid[key] = (update, metrics)
        for key in state.sampled:
            if key not in rows:
                kind, down = state.downlink[key]
                rows[key] = ClientRow(server_round, key, state.node_of[key], "timeout",
                                      reason="no reply before the round timeout",
                                      downlink=kind, downlink_bytes=down)

        # The first clients_per_round valid replies in sampling order: deterministic, unlike
        # arrival order.
        chosen = [k for k in state.sampled if k in valid][: self.clients_per_round]
        for k in valid:
            rows[k].status = "aggregated" if k in chosen else "surplus"
        applied = False
        if chosen:
            keys = sorted(chosen)  # a fixed summation order makes the sum reproducible
            try:
                # A client's signs (dgc.shared) are one more sparse update with its weight.
                signed = [k for k in keys if k in state.signs]
                updates = [valid[k][0] for k in keys] + [state.signs[k] for k in signed]
                applied = self._apply(updates,
                                      [float(rows[k].num_examples) for k in keys + signed],
                                      total_weight=sum(float(rows[k].num_examples) for k in keys))
            except dgc.AggregationError as ex:
                log(WARNING, "\t> Round %d aggregation failed, model unchanged: %s",
                    server_round, ex)
            if not applied:
                for k in chosen:
                    rows[k].status, rows[k].reason = "rejected", "aggregate was not finite"
        # Bookkeeping the next round's messages rely on: the versions each client may hold.
        for key, row in rows.items():
            info = self.clients.setdefault(key, {"acked": -1,
                                                 "versions": list(self.initial_versions)})
            if row.status == "aggregated":
                info["acked"] = server_round
            if self.downlink != "auto" or row.status == "error":
                info["versions"] = []  # dense next time
            elif row.status in ("aggregated", "surplus", "rejected") \
                    or key in self._processed:
                # It answered with content, so it processed the message and holds what we sent.
                info["versions"] = [state.version_sent]
            elif info["versions"]:
                # No answer: it holds what it held, or what we sent if the message reached it.
                info["versions"] = sorted(set(info["versions"]) | {state.version_sent})
            # else: it held nothing we know of and may not have received the model: dense.
        self._processed = set()
        state.validated.clear()  # no reply is held past its round

        ordered = [rows[k] for k in state.sampled]
        self.client_rows.extend(ordered)
        state.rows = ordered
        record = self._round_record(server_round, ordered, uplink)
        self._pending_record = record
        metrics = MetricRecord({
            "uplink_bytes": record.uplink_bytes, "downlink_bytes": record.downlink_bytes,
            "clients_aggregated": record.clients_aggregated,
            "clients_failed": record.clients_failed, "nnz": record.nnz,
            "train_loss": record.train_loss if math.isfinite(record.train_loss) else 0.0,
        })
        log(INFO, "aggregate_train: %d aggregated, %d rejected, %d failed; uplink %d B",
            record.clients_aggregated, record.clients_rejected, record.clients_failed,
            record.uplink_bytes)
        return (self.model_arrays() if applied else None), metrics

    def _decode_replies(self, replies: list[Message],
                        sampled: Iterable[int]) -> dict[int, SparseUpdate | DecodeError]:
        """The decoded update bytes of the replies that will be validated, by ``id(msg)``.

        One ``dgc.decode_many`` call: the replies of a round share their structure, so that the
        headers of all but the first are read against it (a few times faster than one
        ``dgc.decode`` each). Replies it skips (errors, duplicates, no update bytes) are left to
        :meth:`validate_reply`, which rejects them with its own reason.
        """
        wanted = set(sampled)
        validated = self._round.validated if self._round is not None else {}
        ids, messages = [], []
        for msg in replies:
            memo = validated.get(id(msg))
            key = self.node_keys.get(msg.metadata.src_node_id, -1)
            if memo is not None and memo[0] is msg:
                wanted.discard(key)  # validated this round already: nothing to decode
                continue
            if key not in wanted:
                continue
            wanted.discard(key)  # a duplicate is ignored by aggregate_train: do not decode it
            if msg.has_error():
                continue
            arrays = msg.content.array_records.get(P.UPDATE)
            if arrays is None:
                continue
            try:
                messages.append(P.record_to_bytes(arrays, P.UPDATE))
            except ValueError:
                continue
            ids.append(id(msg))
        return dict(zip(ids, dgc.decode_many(messages, max_numel=self._max_numel), strict=True))

    def _count_rejection(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def _apply(self, updates: list[SparseUpdate], weights: list[float],
               total_weight: float | None = None) -> bool:
        """Apply the weighted average of ``updates``: divided by ``total_weight`` (default: the
        sum of ``weights``; the shared signs add updates but no clients)."""
        assert self.model is not None
        shapes = self.shapes
        total = float(sum(weights)) if total_weight is None else float(total_weight)
        if total <= 0:
            raise dgc.AggregationError("total weight is zero; nothing to average")
        if self._aggregate_out is None or {k: tuple(v.shape) for k, v in
                                           self._aggregate_out.items()} != shapes:
            # One block reused every round: no model-sized allocation per round, and decoded
            # updates are scattered into it in one call each.
            self._aggregate_out = dgc.aggregate_buffers(shapes)
        else:
            for buf in self._aggregate_out.values():
                buf.zero_()
        # w * (1 / total): the very factors dgc.aggregate's own normalization computes. Decoded
        # updates and signs go in separate calls, so that the decoded ones keep the packed path.
        scale = 1.0 / total
        packed = [i for i, u in enumerate(updates) if u.packed is not None]
        others = [i for i, u in enumerate(updates) if u.packed is None]
        avg = self._aggregate_out
        for group in (packed, others):
            if group:
                dgc.aggregate([updates[i] for i in group], [weights[i] * scale for i in group],
                              shapes, normalize=False, out=avg)
        if self.server_momentum > 0.0:
            if self.momentum_buffer is None:
                self.momentum_buffer = {k: torch.zeros_like(v) for k, v in self.model.items()}
            step = {k: self.momentum_buffer[k] * self.server_momentum + avg[k] for k in avg}
        else:
            step = avg
        new = OrderedDict((k, v - self.server_learning_rate * step[k])
                          for k, v in self.model.items())
        if not all(torch.isfinite(t).all() for t in new.values()):
            return False
        if self.server_momentum > 0.0:
            self.momentum_buffer = step
        before = self.sent_model
        self.model = new
        if self.broadcast is not None:
            self.broadcast = self._follow(self.broadcast, self._heading(new))
        self.model_version += 1
        changed = {}
        for name, t in self.sent_model.items():
            # bitwise comparison, so a replaced entry reproduces the server's value exactly
            changed[name] = t.view(torch.int32) != before[name].view(torch.int32)
            self.changed_at[name][changed[name]] = self.model_version
        if self.initial_on_grid:
            self._remember(self.model_version, changed, before)
        if self.shared_planner is not None:
            self.shared_planner.observe(avg)
        return True

    def _heading(self, model: OrderedDict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
        """What the broadcast follows: ``model``, or with ``downlink_lookahead`` where the
        server momentum is taking it, ``model - a * lr * m * buf``."""
        if not self.downlink_lookahead or self.momentum_buffer is None:
            return model
        factor = self.downlink_lookahead * self.server_learning_rate * self.server_momentum
        return OrderedDict((k, v - factor * self.momentum_buffer[k]) for k, v in model.items())

    def _follow(self, broadcast: Mapping[str, torch.Tensor],
                model: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
        """The next broadcast model: ``broadcast`` with its matrix entries that differ most
        from ``model`` rounded to float16 replaced by those rounded values (one-dimensional
        tensors are copied whole, unrounded).

        The rounding halves the value bytes of every patch; what it drops (at most half a
        float16 step) stays in ``model - broadcast`` like any entry not sent, and is sent when
        the model moves on (error feedback on the server). Ranking by the rounded difference
        never spends a slot on an entry whose rounded value the clients already hold. With
        ``downlink_values="int8"`` the grid is the tensor's int8 grid instead (a quarter of the
        float32 bytes); a tensor whose grid step had to double is copied whole, re-rounded.
        """
        out = self._copy(broadcast)
        matrices = [k for k, v in model.items() if v.dim() > 1]
        for k, v in model.items():
            if v.dim() <= 1:
                out[k].copy_(v)
        if not matrices:
            return out
        if self.grid_exponents:
            target = {}
            for k in matrices:
                before = self.grid_exponents[k]
                e = grid_exponent(model[k], before)
                self.grid_exponents[k] = e
                target[k] = model[k].clone() if e is None else to_int8_grid(model[k], e)
                if before is not None and e != before:
                    out[k].copy_(target[k])  # a coarser grid: every entry moves onto it
        else:
            target = {k: _float16_grid(model[k]) for k in matrices}
        diff = torch.cat([(target[k] - out[k]).abs().view(-1) for k in matrices])
        count = min(diff.numel(), math.ceil(self.downlink_density * diff.numel()))
        # Ties are broken by position (stable sort), so the selection is reproducible.
        chosen = torch.sort(diff, descending=True, stable=True).indices[:count]
        chosen = chosen[diff[chosen] > 0]
        start = 0
        for k in matrices:
            n = model[k].numel()
            local = chosen[(chosen >= start) & (chosen < start + n)] - start
            out[k].view(-1)[local] = target[k].view(-1)[local]
            start += n
        return out

    def _round_record(self, server_round: int, rows: list[ClientRow], uplink: int) -> RoundRecord:
        assert self._round is not None and self.model is not None
        aggregated = [r for r in rows if r.status == "aggregated"]
        arrived = [r for r in rows if r.status in ("aggregated", "surplus", "rejected")]
        weight = sum(r.num_examples for r in aggregated)
        return RoundRecord(
            round=server_round,
            uplink_bytes=uplink,
            downlink_bytes=sum(r.downlink_bytes for r in rows),
            dense_uplink_bytes=self._dense_update_nbytes * len(arrived),
            dense_downlink_bytes=self._dense_model_nbytes * len(rows),
            clients_sampled=len(rows),
            clients_aggregated=len(aggregated),
            clients_failed=sum(r.status in ("error", "timeout", "rejected") for r in rows),
            clients_rejected=sum(r.status == "rejected" for r in rows),
            patches_sent=sum(r.downlink == "patch" for r in rows),
            nnz=sum(r.nnz for r in aggregated),
            train_loss=(sum(r.train_loss * r.num_examples for r in aggregated) / weight
                        if weight else float("nan")),
            compute_seconds_max=max((r.compute_seconds for r in arrived), default=0.0),
            model_version=self.model_version,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run: model, optimizer, clients, records."""
        assert self.model is not None
        return {
            "strategy_state_version": STRATEGY_STATE_VERSION,
            "completed_rounds": self.completed_rounds,
            "model": dict(self.model),
            "model_names": list(self.model),
            "model_version": self.model_version,
            "broadcast": None if self.broadcast is None else dict(self.broadcast),
            "downlink_values": self.downlink_values,
            "grid_exponents": dict(self.grid_exponents),
            "downlink_deltas": self.downlink_deltas,
            "delta_history": [[u, {n: [i, v] for n, (i, v) in changes.items()}]
                              for u, changes in self._history.items()],
            "momentum_buffer": self.momentum_buffer,
            "changed_at": dict(self.changed_at),
            "clients": {str(k): dict(v) for k, v in self.clients.items()},
            "rounds": [asdict(r) for r in self.rounds],
            "client_rows": [asdict(r) for r in self.client_rows],
            "rejections": dict(self.rejections),
            # Node ids live as long as their SuperNodes: a ServerApp resumed in the same
            # deployment messages them without asking again (in simulation they are just stale).
            "node_keys": {str(n): k for n, k in self.node_keys.items()},
            "shared_planner": (None if self.shared_planner is None
                               else self.shared_planner.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a state for another model changes nothing."""
        if state.get("strategy_state_version") != STRATEGY_STATE_VERSION:
            raise CheckpointError(f"strategy state version {state.get('strategy_state_version')}"
                                  f" is not {STRATEGY_STATE_VERSION}")
        model = state["model"]
        if self.model is not None:
            ours = self.shapes
            theirs = {k: tuple(v.shape) for k, v in model.items()}
            if ours != theirs:
                raise CheckpointError(f"checkpoint model {theirs} does not match the run's "
                                      f"model {ours}")
        # Every refusal comes before the first change, so a refused state changes nothing.
        broadcast = state.get("broadcast")
        if (broadcast is None) != (self.downlink_density == 1.0):
            raise CheckpointError(f"checkpoint was written with downlink_density "
                                  f"{'1' if broadcast is None else '< 1'}, the run has "
                                  f"{self.downlink_density:g}: clients hold the other model")
        written = state.get("downlink_values", "float16")
        if broadcast is not None and written != self.downlink_values:
            raise CheckpointError(f"checkpoint was written with downlink_values {written}, the "
                                  f"run has {self.downlink_values}: clients hold the other grid")
        grid_exponents = dict(state.get("grid_exponents", {}))
        deltas = bool(state.get("downlink_deltas", False))
        if grid_exponents and deltas != self.downlink_deltas:
            raise CheckpointError(f"checkpoint was written with downlink_deltas {deltas}, the "
                                  f"run has {self.downlink_deltas}: version 0 is "
                                  f"{'' if deltas else 'not '}on the grid there")
        self.model = OrderedDict((k, model[k].to(torch.float32).contiguous())
                                 for k in state["model_names"])
        self.broadcast = None if broadcast is None else OrderedDict(
            (k, broadcast[k].to(torch.float32).contiguous()) for k in state["model_names"])
        self.grid_exponents = grid_exponents
        self._forget_history()
        for u, changes in state.get("delta_history", []):
            self._history[int(u)] = {n: (i.to(torch.int64), v.to(torch.float32))
                                     for n, (i, v) in changes.items()}
            self._history_nbytes += _history_nbytes(self._history[int(u)])
        self._measure_dense()
        self.completed_rounds = int(state["completed_rounds"])
        self.model_version = int(state["model_version"])
        self.momentum_buffer = state["momentum_buffer"]
        if "changed_at" in state:
            self.changed_at = {k: state["changed_at"][k].to(torch.int32).contiguous()
                               for k in state["model_names"]}
        else:  # an older checkpoint (past models instead): patches only from now on
            self.changed_at = {k: torch.full(v.shape, self.model_version, dtype=torch.int32)
                               for k, v in self.model.items()}
        self.clients = {int(k): _client_info(v) for k, v in state["clients"].items()}
        self.rounds = [RoundRecord(**r) for r in state["rounds"]]
        self.client_rows = [ClientRow(**r) for r in state["client_rows"]]
        self.rejections = dict(state["rejections"])
        self.register_clients({int(n): int(k) for n, k in state.get("node_keys", {}).items()})
        planner_state = state.get("shared_planner")
        if self.shared_planner is not None and planner_state is not None:
            self.shared_planner.load_state_dict(planner_state)

    # ------------------------------------------------------------------ the loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run rounds ``completed_rounds + 1 .. num_rounds`` (Flower's loop, plus checkpoints).

        ``evaluate_fn`` is expected to return a MetricRecord with ``accuracy`` (a fraction) and
        ``loss``; they fill :class:`RoundRecord`.
        """
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self.set_model(initial_arrays)
        if self.resume and self.checkpoint_dir is not None:
            saved = load_checkpoint(self.checkpoint_dir)
            if saved is not None:
                self.load_state_dict(saved)
                log(INFO, "Resumed from %s after round %d", self.checkpoint_dir,
                    self.completed_rounds)
        result = Result()
        for r in self.rounds:
            result.evaluate_metrics_serverapp[r.round] = MetricRecord(
                {"accuracy": r.accuracy, "loss": r.loss})
        if evaluate_fn and self.completed_rounds == 0:
            res = evaluate_fn(0, self.model_arrays())
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        for current_round in range(self.completed_rounds + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            started = time.time()
            replies = grid.send_and_receive(
                messages=self.configure_train(current_round, self.model_arrays(),
                                              train_config, grid),
                timeout=timeout)
            _, train_metrics = self.aggregate_train(current_round, replies)
            if train_metrics is not None:
                result.train_metrics_clientapp[current_round] = train_metrics
            if self.fraction_evaluate > 0:
                eval_replies = grid.send_and_receive(
                    messages=self.configure_evaluate(current_round, self.model_arrays(),
                                                     evaluate_config, grid),
                    timeout=timeout)
                agg = self.aggregate_evaluate(current_round, eval_replies)
                if agg is not None:
                    result.evaluate_metrics_clientapp[current_round] = agg
            record = self._pending_record
            if evaluate_fn:
                res = evaluate_fn(current_round, self.model_arrays())
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
                    record.accuracy = float(res.get("accuracy", float("nan")))  # type: ignore
                    record.loss = float(res.get("loss", float("nan")))  # type: ignore
            record.wall_seconds = time.time() - started
            self.rounds.append(record)
            self.completed_rounds = current_round
            if self.checkpoint_dir is not None:
                save_checkpoint(self.checkpoint_dir, self.state_dict())
            if self.on_round is not None:
                self.on_round(record)
        result.arrays = self.model_arrays()
        return result


def _history_nbytes(changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(i.numel() * i.element_size() + v.numel() * v.element_size()
               for i, v in changes.values())


def _client_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpointed client entry; older checkpoints kept one ``version`` (-1: unknown)."""
    if "versions" in info:
        versions = [int(v) for v in info["versions"]]
    else:
        versions = [int(info["version"])] if int(info.get("version", -1)) >= 0 else []
    return {"acked": int(info["acked"]), "versions": versions}


def _payload_nbytes(msg: Message) -> int:
    return sum(P.record_nbytes(r) for r in msg.content.array_records.values())
