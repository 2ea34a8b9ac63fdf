"""The server's part of a private round: SecAgg+ over the round's shared coordinates as real
Flower messages, DP-FedAvg's central noise on the sum, and the privacy spent.

Under ``privacy.secagg`` (:mod:`fedgc.privacy.secagg`, docs/privacy.md) a round runs:

1. :meth:`PrivateRound.open` (in ``configure_train``): the session over the sampled clients,
   its setup and share-keys stages as queries of action ``secagg`` (message type
   ``query.secagg``) through the round's Grid; a client that does not answer a stage drops
   out of the session there (and is sent no train message);
2. the train message carries each client's stage-2 request (its neighbours' encrypted shares);
   its reply the masked vector (:meth:`PrivateRound.check_round` reads it);
3. :meth:`PrivateRound.secure_mean` (in the aggregation): the unmasking, a last query to the
   clients whose vectors the round takes; the sum of those, from the fixed point, divided by
   their count (each client counts once: the server cannot weigh a masked vector), central
   noise added (``privacy.dp = central``), back in the method's space
   (:meth:`fedgc.privacy.linear.Layout.combined`).

Without secure aggregation, ``privacy.dp = central`` clips each decoded payload to
``privacy.clip`` (clients also clip their pseudo-gradient before compressing:
``client.secure.clipped``), averages them unweighted and adds the noise
(:meth:`PrivateRound.noisy_mean`); for a method whose clients then send its sets only
(``dgc_sets``, ``tcs``: :meth:`fedgc.methods.Method.sets_only`) it does so at the round's
layout, the noise there only (:meth:`PrivateRound.layout_mean`). Either way the accountant
(``dp-accounting``) records a round of the Poisson-sampled Gaussian mechanism at
``q = clients_per_round / num_clients``, and this extension adds ``dp_epsilon`` to
``rounds.csv``, the guarantee to ``summary.json``, and the session's counts and bytes
(``secagg_*``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedgc import protocol as P
from fedgc.methods import Method, Payload
from fedgc.privacy import FixedPoint, FixedPointError
from fedgc.privacy.dp import (
    AdaptiveClip,
    DiscreteGaussianAccountant,
    DistributedDiscreteGaussian,
    GaussianAccountant,
    clip_vector,
)
from fedgc.privacy.linear import Layout, round_layout
from fedgc.privacy.secagg import ROUND_TRIPS, STAGES, SecAggError, ServerSession
from fedgc.privacy.secagg.cost import StageBytes
from server.extensions import Added, Column, RoundExtension, exchanged
from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply, ReplyRejected, recorded_fields, reply_numbers

__all__ = ["PrivateRound"]

#: The message type of the stages no train message carries.
STAGE_MESSAGE = f"{MessageType.QUERY}.{P.SECAGG_ACTION}"


def payload_norm(payload: Payload) -> float:
    """The L2 norm of a decoded payload's values, every part (its side part too)."""
    return math.sqrt(sum(float(t.values.to(torch.float64).pow(2).sum())
                         for part in payload.parts() for t in part.tensors.values()))


class PrivateRound(RoundExtension):
    """Secure aggregation and central DP in a round (module docstring).

    Parameters
    ----------
    train : TrainSettings
        The run's clients' keys (the ``privacy.*`` keys among them).
    method : fedgc.methods.Method
        The run's method (its layout under secure aggregation).
    timeout : float
        Seconds each stage's messages may take (the round timeout).
    """

    def __init__(self, train: Any, method: Method, timeout: float = 3600.0) -> None:
        self.train, self.method, self.timeout = train, method, float(timeout)
        self.secagg, self.dp = bool(train.privacy_secagg), str(train.privacy_dp)
        self.clip, self.noise_multiplier = train.privacy_clip, train.privacy_noise_multiplier
        #: The sampling assumption: each client in a round with this probability (Poisson).
        self.sampling_rate = train.clients_per_round / train.num_clients
        # The distributed noise's accountant is made with the first round's mechanism.
        self.accountant: GaussianAccountant | DiscreteGaussianAccountant | None = (
            GaussianAccountant(train.privacy_delta, train.privacy_accountant)
            if self.dp == "central" else None)
        self.mechanism: DistributedDiscreteGaussian | None = None
        #: Adaptive clipping (Andrew et al.; ``privacy.clip_quantile``): the clip the server
        #: moves each round from the noised count of the clients' clip bits. The bits and the
        #: update share the noise multiplier z (the accountant records z each round): the
        #: update's own noise is ``z_u = (z^-2 - (2 sigma_b)^-2)^-1/2`` (with sigma_b =
        #: clients_per_round / 20, the paper's; keys check 2 sigma_b > z at start).
        self.adaptive: AdaptiveClip | None = None
        self.update_noise_multiplier = self.noise_multiplier
        if train.adaptive_clip:
            self.adaptive = AdaptiveClip.for_clients(
                train.clients_per_round, clip=train.privacy_clip,
                target_quantile=train.privacy_clip_quantile,
                learning_rate=train.privacy_clip_learning_rate)
            self.update_noise_multiplier = self.adaptive.update_noise_multiplier(
                self.noise_multiplier)
        self._round_clip = self.clip  # the clip this round's clients were sent
        self._bits = 0.0  # the last round's sum of clip bits (before their noise)
        self._resumed: Mapping[str, Any] | None = None  # a checkpoint's discrete RDP
        self.columns = ((Column("secagg_clients"), Column("secagg_dropped"),
                         Column("secagg_overhead_bytes"), Column("secagg_round_trips"),
                         Column("secagg_saturated"))
                        if self.secagg else ()) + (
            (Column("dp_epsilon", "privacy/epsilon", "eps {0:.3g}"),)
            if self.dp != "off" else ()) + (
            (Column("dp_clip", "privacy/clip"), Column("dp_clip_bits"))
            if self.adaptive is not None else ())
        self.session: ServerSession | None = None
        self.layout: Layout | None = None
        self.fixed_point: FixedPoint | None = None
        #: Why the round's secure sum failed ("" when it did not).
        self.failure = ""
        self._bytes: dict[int, dict[str, StageBytes]] = {}
        self._grid: Grid | None = None
        self._node_of: dict[int, int] = {}
        self._round = 0
        self._silent: set[int] = set()  # summed clients that did not answer the unmasking
        self._saturated: dict[int, int] = {}  # coordinates each client's fixed point clamped
        #: The round's extensions (the strategy's), shown each exchange.
        self.extensions: Sequence[RoundExtension] = ()

    def describe(self) -> str:
        parts = []
        if self.secagg:
            parts.append(f"secure aggregation (SecAgg+, {self.train.privacy_value_bits}-bit "
                         f"values in [-{self.train.fixed_point_range:g}, "
                         f"{self.train.fixed_point_range:g}], {ROUND_TRIPS} round trips)")
        if self.dp != "off":
            account = (f"dp-accounting {self.train.privacy_accountant.upper()}"
                       if self.dp == "central" else "Kairouz et al.'s RDP")
            parts.append(f"client-level DP ({self.dp} noise, clip {self.clip:g}, noise "
                         f"multiplier {self.noise_multiplier:g}, delta "
                         f"{self.train.privacy_delta:g}, sampling q = {self.sampling_rate:.4g} "
                         f"assumed Poisson, {account})")
        if self.adaptive is not None:
            parts.append(f"adaptive clipping (Andrew et al.: quantile "
                         f"{self.adaptive.target_quantile:g}, learning rate "
                         f"{self.adaptive.learning_rate:g}, bits' noise std "
                         f"{self.adaptive.count_noise:g}, update noise multiplier "
                         f"{self.update_noise_multiplier:.4g})")
        return "privacy: " + "; ".join(parts) + "; every client counts once (unweighted mean)"

    # ------------------------------------------------------------------ adaptive clipping
    def message_keys(self, server_round: int, client_key: int) -> dict[str, float]:
        """The round's clip in each train message under adaptive clipping."""
        return {} if self.adaptive is None else {P.DP_CLIP: self._round_clip}

    @property
    def _bit_coordinates(self) -> int:
        """1 when the masked vector carries the clip bit (adaptive clipping under SecAgg)."""
        return int(self.adaptive is not None and self.secagg)

    def adapt_clip(self, bits_sum: float) -> None:
        """Step the clip from the round's sum of bits (clamped to what the round's clients can
        sum: a hostile client moves it by at most one bit's worth more than an honest one)
        and the bits' noise; the next round's clients are sent the new clip."""
        assert self.adaptive is not None
        expected = float(self.train.clients_per_round)
        self._bits = min(max(float(bits_sum), 0.0), expected)
        rng = np.random.default_rng([self.train.seed, self._round, 0xB1])
        self._round_clip = self.adaptive.update(self._bits, expected, rng)

    def bits_of(self, chosen: Sequence[CheckedReply]) -> float:
        """The sum of the clip bits in ``chosen``'s metrics (without secure aggregation); a
        missing or malformed bit counts 0."""
        total = 0
        for reply in chosen:
            metrics = reply.message.content.metric_records.get(P.METRICS)
            value = None if metrics is None else metrics.get(P.DP_CLIP_BIT)
            total += int(value is not None and not isinstance(value, bool) and value == 1)
        return float(total)

    # ------------------------------------------------------------------ secure aggregation
    def layout_of(self, space: Mapping[str, tuple[int, ...]], material: Any,
                  server_round: int) -> Layout:
        """The round's shared coordinates (the clients compute the same)."""
        return round_layout(self.method, self.train, space, material, server_round)

    def open(self, grid: Grid, server_round: int, node_of: Mapping[int, int],
             layout: Layout) -> dict[int, bytes]:
        """Run the setup and share-keys stages with the sampled clients (``node_of``: client
        key -> node id); each client still in the session's stage-2 request. Empty when the
        session could not go on (``failure`` says why)."""
        self._grid, self._node_of, self._round = grid, dict(node_of), server_round
        self.layout, self.failure, self._bytes = layout, "", {k: {} for k in node_of}
        self._silent = set()
        self._saturated: dict[int, int] = {}
        keys = sorted(node_of)
        t = self.train = dataclasses.replace(self.train, privacy_clip=self._round_clip)
        try:
            self.fixed_point = FixedPoint.for_clients(len(keys), t.fixed_point_range,
                                                      t.privacy_value_bits)
            if self.dp == "distributed":
                # The ring holds the sum of the shares with their noise's tails.
                self.mechanism = DistributedDiscreteGaussian.for_keys(t, layout.length)
                self.fixed_point = FixedPoint(t.fixed_point_range, t.privacy_value_bits, max(
                    self.fixed_point.modulus_bits, self.mechanism.min_modulus_bits(len(keys))))
                if self.accountant is None:
                    self.accountant = DiscreteGaussianAccountant(t.privacy_delta,
                                                                 self.mechanism)
                    if self._resumed:
                        self.accountant.events = [(int(n), float(q), int(r)) for n, q, r
                                                  in self._resumed["events"]]
                        self.accountant._rdp = np.asarray(self._resumed["rdp"], dtype=float)
            self.session = ServerSession(keys, max(layout.length + self._bit_coordinates, 1),
                                         self.fixed_point.modulus_bits,
                                         neighbours=t.privacy_neighbours or None,
                                         server_round=server_round)
            requests = self.session.setup()
            requests = self.session.share_keys(self._exchange(STAGES[0], requests))
            requests = self.session.collect_masked_vectors(self._exchange(STAGES[1], requests))
        except (SecAggError, FixedPointError) as ex:
            self.failure = f"secure aggregation failed: {ex}"
            log(WARNING, "\t> Round %d: %s", server_round, self.failure)
            return {}
        for key, data in requests.items():
            self._bytes[key][STAGES[2]] = StageBytes(len(data), 0)
        return requests

    def _exchange(self, stage: str, requests: Mapping[int, bytes]) -> dict[int, bytes]:
        """Send a stage's requests as Flower messages; the replies that came, by client key
        (an error reply, or one without its bytes, is a client that dropped out here)."""
        assert self._grid is not None
        messages = [Message(RecordDict({P.SECAGG: P.bytes_to_record(data, P.SECAGG)}),
                            dst_node_id=self._node_of[key], message_type=STAGE_MESSAGE,
                            group_id=str(self._round)) for key, data in requests.items()]
        key_of = {self._node_of[k]: k for k in requests}
        for key, data in requests.items():
            self._bytes[key][stage] = StageBytes(len(data), 0)
        out: dict[int, bytes] = {}
        replies = self._grid.send_and_receive(messages, timeout=self.timeout)
        for reply in replies:
            key = key_of.get(reply.metadata.src_node_id)
            if key is None or reply.has_error() or key in out:
                continue
            record = reply.content.array_records.get(P.SECAGG)
            try:
                data = P.record_to_bytes(record, P.SECAGG) if record is not None else b""
            except ValueError:
                continue
            if data:
                out[key] = data
                self._bytes[key][stage] = StageBytes(self._bytes[key][stage].down, len(data))
        # The other extensions (the emulator) charge the exchange and say whose reply came.
        sizes = {k: (len(requests[k]), len(out.get(k, b""))) for k in requests}
        came = exchanged([e for e in self.extensions if e is not self], self._round, stage,
                         sizes)
        return {k: v for k, v in out.items() if k in came}

    def check_round(self, replies: Iterable[Message], key_of: Callable[[Message], tuple[int, int]],
                    sampled: Iterable[int], weighted_by_key: str) -> list[CheckedReply]:
        """Every train reply of a secure round, checked, in order: "valid" with its masked
        vector's bytes as the uplink (its vector is read by the session at the unmasking)."""
        wanted, seen, out = set(sampled), set(), []
        for msg in replies:
            key, node = key_of(msg)
            if key not in wanted or key in seen:
                out.append(CheckedReply(msg, key, node, "ignored", "reply from a node that was "
                                        "not sampled or replied twice"))
            elif msg.has_error():
                out.append(CheckedReply(msg, key, node, "error", msg.error.reason))
            else:
                out.append(self._check(msg, key, node, weighted_by_key))
            seen.add(key)
        return out

    def _check(self, msg: Message, key: int, node: int, weighted_by_key: str) -> CheckedReply:
        recorded = recorded_fields(msg)
        try:
            metrics = msg.content.metric_records.get(P.METRICS)
            if metrics is None:
                raise ReplyRejected(f"no {P.METRICS!r} MetricRecord")
            numbers = reply_numbers(metrics, weighted_by_key)
            clamped = metrics.get(P.SECAGG_SATURATED, 0)
            if isinstance(clamped, bool) or not isinstance(clamped, int) or clamped < 0:
                raise ReplyRejected(f"{P.SECAGG_SATURATED} must be a whole number >= 0, got "
                                    f"{clamped!r}")
            record = msg.content.array_records.get(P.SECAGG)
            if record is None:
                raise ReplyRejected(f"no {P.SECAGG!r} ArrayRecord (a masked vector) in a "
                                    f"secure round")
            try:
                data = P.record_to_bytes(record, P.SECAGG)
            except ValueError as ex:
                raise ReplyRejected(str(ex)) from ex
        except ReplyRejected as ex:
            return CheckedReply(msg, key, node, "rejected", str(ex), **recorded)
        self._saturated[key] = clamped
        if key in self._bytes:
            down = self._bytes[key].get(STAGES[2], StageBytes(0, 0)).down
            self._bytes[key][STAGES[2]] = StageBytes(down, len(data))
        return CheckedReply(msg, key, node, "valid", uplink_bytes=len(data),
                            num_examples=numbers.num_examples, train_loss=numbers.train_loss,
                            compute_seconds=numbers.compute_seconds, restored=numbers.restored,
                            **recorded)

    def secure_mean(self, chosen: Sequence[CheckedReply],
                    space: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
        """The unmasked mean of ``chosen``'s vectors in the method's space (noised under
        central DP), after the unmasking stage; None when the session failed (``failure``)."""
        assert self.session is not None and self.layout is not None
        assert self.fixed_point is not None
        masked = {}
        for reply in chosen:
            masked[reply.client_key] = P.record_to_bytes(
                reply.message.content.array_records[P.SECAGG], P.SECAGG)
        try:
            requests = self.session.unmask(masked)
            reveals = self._exchange(STAGES[3], requests)
            # In the sum, but gone before revealing its shares: its self mask is rebuilt.
            self._silent = set(requests) - set(reveals)
            total = self.session.result(reveals)
            count = len(self.session.summed)
            if self.mechanism is not None:  # the shares' sum, their noise in it
                summed = self.fixed_point.from_ring(
                    total, self.mechanism.sum_bound(count)) * self.mechanism.step
            else:
                summed = self.fixed_point.decode_sum(total, count)
        except (SecAggError, FixedPointError) as ex:
            self.failure = f"secure aggregation failed: {ex}"
            log(WARNING, "\t> Round %d: %s", self._round, self.failure)
            return None
        length = self.layout.length
        if self.dp == "central":
            summed = np.concatenate([summed[:length] + self._noise((length,)),
                                     summed[length:]])
        elif isinstance(self.accountant, DiscreteGaussianAccountant):
            # Each round's mechanism (its dimension may change with the layout) is accounted
            # with the shares actually summed: fewer than sized for spend more.
            self.accountant.mechanism = self.mechanism
            self.accountant.record(count, self.sampling_rate)
        log(INFO, "\t> Secure sum of %d clients (%d coordinates, %d-bit ring); dropped: %s",
            count, self.layout.length, self.fixed_point.modulus_bits,
            dict(sorted(self.session.dropped.items())[:8]))
        if self._bit_coordinates:  # the bits' coordinate: each bit times the range
            self.adapt_clip(float(summed[length]) / self.fixed_point.clip)
        return self.layout.combined(summed[:length], float(count))

    # ------------------------------------------------------------------ central DP
    def clip_factors(self, payloads: Sequence[Payload]) -> list[float]:
        """Each payload's factor to norm ``privacy.clip`` at most (central DP's clip of what
        enters the sum: compression and the residual may have grown the client's clip)."""
        return [min(1.0, self._round_clip / n) if n > 0 else 1.0
                for n in (payload_norm(p) for p in payloads)]

    def layout_mean(self, payloads: Sequence[Payload], layout: Layout
                    ) -> dict[str, torch.Tensor]:
        """Central DP at the round's shared coordinates, for a method whose clients send its
        sets only (:meth:`fedgc.methods.Method.sets_only`): each payload's vector at
        ``layout`` (entries elsewhere, which an honest client held back, left out), clipped to
        the round's clip, summed, ``N(0, (z S)^2)`` added at the layout's coordinates only
        (the others are zero whatever any client's data, as under secure aggregation) and
        divided by the count, in the method's space."""
        total = np.zeros(layout.length, dtype=np.float64)
        norms = []
        for payload in payloads:
            clipped, norm = clip_vector(layout.vector(payload, strict=False), self._round_clip)
            total += clipped
            norms.append(norm)
        if norms:  # how much the server's clip cut (the clients' own clip came before compression)
            log(INFO, "\t> Central DP at the sets: %d of %d vectors clipped to %.3g, norms "
                "median %.3g, max %.3g", sum(n > self._round_clip for n in norms), len(norms),
                self._round_clip, float(np.median(norms)), max(norms))
        return layout.combined(total + self._noise((layout.length,)), float(len(payloads)))

    def noisy_mean(self, mean: Mapping[str, torch.Tensor], count: int
                   ) -> dict[str, torch.Tensor]:
        """``mean`` (of ``count`` clipped contributions) plus the noise of their sum / count."""
        flat = np.concatenate([t.detach().to(torch.float64).reshape(-1).numpy()
                               for t in mean.values()])
        flat = flat + self._noise(flat.shape) / count
        out, at = {}, 0
        for name, t in mean.items():
            out[name] = torch.from_numpy(flat[at:at + t.numel()]).to(torch.float32).view(t.shape)
            at += t.numel()
        return out

    def _noise(self, shape: tuple[int, ...]) -> np.ndarray:
        """``N(0, (z S)^2)`` per coordinate of a sum; the round recorded by the accountant.

        Seeded by the run's seed and round, so that a simulation repeats: a deployment that
        means its guarantee must draw from the OS (a key for it is future work)."""
        assert isinstance(self.accountant, GaussianAccountant)
        # z covers the update and, under adaptive clipping, the clip bits (their release is
        # charged here: the update's own noise is the smaller z_u).
        self.accountant.record(self.noise_multiplier, self.sampling_rate)
        rng = np.random.default_rng([self.train.seed, self._round, 0xD9])
        return rng.normal(0.0, self.update_noise_multiplier * self._round_clip, shape)

    def noise_round(self, server_round: int) -> None:
        """Tell the round the noise is drawn for (the strategy, before :meth:`noisy_mean`)."""
        self._round = server_round

    # ------------------------------------------------------------------ the extension
    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        added = Added()
        if self.secagg:
            session = self.session
            dropped = {} if session is None else session.dropped
            for row in rows:
                if row.client_key in dropped and row.status == "timeout":
                    row.reason = ("secure aggregation: left the session at "
                                  + dropped[row.client_key])
            overhead = [sum(b.down + b.up for s, b in stages.items() if s != STAGES[2])
                        + stages.get(STAGES[2], StageBytes(0, 0)).down
                        for stages in self._bytes.values()]
            added.round.update({
                "secagg_clients": 0 if session is None else len(session.summed),
                "secagg_dropped": len(dropped) + len(self._silent),
                "secagg_overhead_bytes": int(sum(overhead)),
                "secagg_round_trips": ROUND_TRIPS,
                # Coordinates the fixed point clamped, in the summed vectors (as the clients
                # say: privacy.value_range too small when this is not 0).
                "secagg_saturated": sum(self._saturated.get(k, 0) for k in
                                        (session.summed if session is not None else ()))})
            for key, stages in self._bytes.items():
                added.clients[key] = {f"secagg_{s}_bytes": b.down + b.up
                                      for s, b in stages.items()}
        if self.dp != "off":
            added.round["dp_epsilon"] = (0.0 if self.accountant is None
                                         else self.accountant.epsilon())
        if self.adaptive is not None:
            used = self.adaptive.history[-1] if self.adaptive.history else self._round_clip
            added.round.update({"dp_clip": used, "dp_clip_bits": self._bits})
        return added

    def summary(self, rounds: Sequence[RoundRecord]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.secagg:
            out["secagg"] = {"round_trips": ROUND_TRIPS,
                             "overhead_bytes": int(sum(r.extra.get("secagg_overhead_bytes", 0)
                                                       for r in rounds)),
                             "value_bits": self.train.privacy_value_bits,
                             "value_range": self.train.fixed_point_range}
        if self.accountant is not None:
            g = self.accountant.guarantee()
            out.update({"dp_epsilon": g.epsilon, "dp_delta": g.delta,
                        "dp_noise_multiplier": self.noise_multiplier, "dp_clip": self.clip,
                        "dp_sampling_rate": self.sampling_rate, "dp_guarantee": g.statement})
        if self.adaptive is not None:
            out["dp_adaptive_clip"] = {
                "target_quantile": self.adaptive.target_quantile,
                "learning_rate": self.adaptive.learning_rate,
                "count_noise": self.adaptive.count_noise,
                "update_noise_multiplier": self.update_noise_multiplier,
                "final_clip": self._round_clip}
        return out

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.accountant, GaussianAccountant):
            adaptive = ({} if self.adaptive is None
                        else {"adaptive_clip": self.adaptive.state_dict()})
            return {"accountant": self.accountant.state_dict(), **adaptive}
        if isinstance(self.accountant, DiscreteGaussianAccountant):
            # The RDP composed so far (each round's mechanism is gone once recorded).
            return {"discrete": {"events": [list(e) for e in self.accountant.events],
                                 "rdp": [float(x) for x in self.accountant._rdp]}}
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if isinstance(self.accountant, GaussianAccountant) and "accountant" in state:
            self.accountant.load_state_dict(state["accountant"])
        if self.adaptive is not None and "adaptive_clip" in state:
            self.adaptive.load_state_dict(state["adaptive_clip"])
            self._round_clip = self.adaptive.clip
        self._resumed = state.get("discrete")
