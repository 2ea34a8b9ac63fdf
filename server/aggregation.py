"""The combine stage of the server's aggregation: the round's payloads, after the defences
(:mod:`server.defences`), to one sum in the aggregator's space.

``aggregation = mean``: the weighted average of the payloads' sparse parts, scattered in
O(total nonzeros) into one buffer that is reused every round (:class:`SparseAverage`); a
coordinate-wise statistic (``trimmed_mean``, ``median``; Yin et al., ICML 2018): over the union
of the round's indices, never densifying more (:func:`robust_average`); ``centered_clip`` and
``fltrust``, which keep a center across rounds or use the server's own root update
(:mod:`server.robust`). Every one reads payloads only through :class:`fedgc.methods.Payload`
(``parts``), so every method and payload kind goes through the same stage; the method's
aggregator then finishes the round (:class:`fedgc.methods.Aggregator`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import dgc
from dgc import SparseUpdate
from fedgc.keys.server import AGGREGATIONS, GATE_REFERENCES
from fedgc.methods import Payload
from server.robust import CenteredClip, client_entries, cosines, fltrust, space_offsets


class SparseAverage:
    """Averages decoded updates into a model-sized buffer allocated once per model shape."""

    def __init__(self) -> None:
        self._out: dict[str, torch.Tensor] | None = None

    def __call__(self, updates: list[SparseUpdate], weights: list[float], total_weight: float,
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """``sum(w * u) / total_weight``; ``dgc.AggregationError`` when the total is not > 0.

        The result is the reused buffer: valid until the next call.
        """
        total = float(total_weight)
        if total <= 0:
            raise dgc.AggregationError("total weight is zero; nothing to average")
        if self._out is None or {k: tuple(v.shape) for k, v in self._out.items()} != shapes:
            self._out = dgc.aggregate_buffers(shapes)
        else:
            for buf in self._out.values():
                buf.zero_()
        # w * (1 / total): the very factors dgc.aggregate's own normalization computes. Decoded
        # updates and signs go in separate calls, so that the decoded ones keep the packed path.
        scale = 1.0 / total
        packed = [i for i, u in enumerate(updates) if u.packed is not None]
        others = [i for i, u in enumerate(updates) if u.packed is None]
        for group in (packed, others):
            if group:
                dgc.aggregate([updates[i] for i in group], [weights[i] * scale for i in group],
                              shapes, normalize=False, out=self._out)
        return self._out



#: ``gate_reference = trend``: the share of the last trend kept each round (momentum's usual
#: 0.9: a reference that a minority let in for a round or two moves by a tenth each time).
TREND_MOMENTUM = 0.9
#: ``gate_memory``: a client whose record (its left-outs, each decayed by ``gate_memory`` per
#: round it takes part in) reaches this is left out while it stays there: twice left out in a
#: row (1 + memory), or twice within a few rounds, but never once alone (a single left-out of
#: an honest outlier costs it nothing more).
REPEAT_OFFENCES = 1.5
#: A record that decayed below this is forgotten (the checkpoint keeps only live records).
FORGOTTEN = 0.01
#: The coordinate-wise statistics (:func:`robust_average`).
COORDINATE_WISE = ("trimmed_mean", "median")
#: Every combine that is not the plain weighted mean.
ROBUST = tuple(a for a in AGGREGATIONS if a != "mean")


def trimmed_count(how: str, trim_fraction: float, k: int) -> int:
    """Clients cut at each end of every coordinate among ``k``: the median keeps one or two;
    the trimmed mean cuts ``trim_fraction * k`` rounded down, but at least one when
    ``trim_fraction`` is above 0 (0.1 of 5 clients would cut none), and fewer than half."""
    if how == "median":
        return (k - 1) // 2
    if trim_fraction <= 0:
        return 0
    return min(max(math.floor(trim_fraction * k), 1), (k - 1) // 2)


def robust_average(clients: list[list[SparseUpdate]], factors: list[float], how: str,
                   trim_fraction: float, shapes: Mapping[str, tuple[int, ...]],
                   ) -> dict[str, torch.Tensor]:
    """The coordinate-wise trimmed mean (:func:`trimmed_count` of the K clients cut at each
    end) or median of the clients' updates, unweighted, in O(n log n) for n nonzeros in all.

    ``clients[i]``: client i's sparse updates (its update and signs), summed; ``factors[i]``
    scales them (the norm clip). An entry a client did not send is a 0 in its column, so the
    zeros of a coordinate are never materialized: its sorted column is its negative values,
    then K - m zeros, then its positive values, and an entry's place follows from its rank among
    the m values sent.
    """
    offsets, total = space_offsets(shapes)
    k = len(clients)
    trim = trimmed_count(how, trim_fraction, k)
    entries = [client_entries(parts, factor, offsets)
               for parts, factor in zip(clients, factors, strict=True)]
    idx, val = torch.cat([e[0] for e in entries]), torch.cat([e[1] for e in entries])
    by_value = torch.argsort(val, stable=True)
    order = by_value[torch.argsort(idx[by_value], stable=True)]  # by coordinate, then value
    idx, val = idx[order], val[order]
    _, counts = torch.unique_consecutive(idx, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.arange(idx.numel()) - starts
    place = torch.where(val < 0, rank, k - torch.repeat_interleave(counts, counts) + rank)
    keep = (place >= trim) & (place < k - trim)
    out = torch.zeros(total, dtype=torch.float64)
    out.index_add_(0, idx[keep], val[keep] / (k - 2 * trim))
    return _split(out, shapes, offsets)


def _split(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]],
           offsets: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A flat float64 vector of the space as float32 tensors by name."""
    return {n: flat[offsets[n]:offsets[n] + math.prod(s)].to(torch.float32).view(s)
            for n, s in shapes.items()}


class Combine:
    """The combine stage: ``how`` = "mean" (weighted by the capped weights, each payload scaled
    by its clip factor) or one of :data:`ROBUST`: the coordinate-wise statistics (unweighted,
    ``trim_fraction`` for the trimmed mean), ``centered_clip`` (weighted, ``clip_radius``,
    ``clip_iterations``, ``bucket_size`` (bucket means clipped instead of clients, their order
    drawn from ``seed``); its center is kept across rounds, :meth:`state_dict`) or ``fltrust``
    (``root(shapes)``: the server's own update on its root set, flat float64 over the space;
    claimed weights are ignored).

    ``min_cosine`` above -1 puts a direction gate before any of them: an update whose cosine
    with the robust direction of history (the last round's combined aggregate: centered
    clipping's center, which "Learning from History" trusts, Karimireddy et al. 2021) is below
    ``min_cosine`` is left out of the round (:attr:`left_out`: its index and cosine), a
    minority at most (the lowest cosines: a round keeps more than half its updates). It is
    FLTrust's trust score (Cao et al., NDSS 2021: ``ReLU(cos)`` against a trusted direction)
    used as a filter before the combine, as FLAME filters by direction (Nguyen et al., USENIX
    Security 2022), with history as the trusted direction instead of the server's own data;
    this round's clients cannot turn it. Without history (round 1) nothing is left out. The
    combined result is the next round's center whatever ``how`` is. ``gate_reference =
    "round"`` judges by this round's centered clipping of every update from history instead
    (the majority's direction now: a minority that got in once cannot turn it).

    ``gate_memory`` above 0 makes the gate remember a repeat offender (the calls that name
    their ``client_keys``): each client's record is its left-outs, each decayed by ``gate_memory``
    per round it takes part in; a client whose record reached :data:`REPEAT_OFFENCES` is left
    out (:attr:`held_out`) whatever its cosine, still within the minority bound, until its
    record decays below it. A sign flipper left out in most early rounds has then gathered a
    record that keeps it out when, later, its update comes to point with history (issue 35's
    mnist5k at 40 rounds); an honest client left out once is not held. The record is judged
    by the cosine alone, so an update held out that now passes decays its record.
    ``memory_below``: only a clear offence opens a record: a left-out starts a client's record
    only when its cosine is below this too; once a record is open (until it is forgotten),
    every left-out counts. A sign flipper's first updates point clearly against the reference
    and open its record, and its later left-outs near the bar then count as before; an honest
    outlier left out near the bar (the colluders' min-max turns the reference against a few
    honest clients) never opens one. At or above ``min_cosine`` (0, the deployed bar, and the
    key's default) every left-out counts.
    """

    def __init__(self, how: str = "mean", trim_fraction: float = 0.1, clip_radius: float = 1.0,
                 clip_iterations: int = 3,
                 root: Callable[[Mapping[str, tuple[int, ...]]], torch.Tensor] | None = None,
                 min_cosine: float = -1.0, bucket_size: int = 1, seed: int = 0,
                 gate_reference: str = "history", gate_memory: float = 0.0,
                 clean_radius: float = 0.0, memory_below: float = 0.0,
                 first_bar: float | None = None) -> None:
        if how not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {how!r}")
        if how == "fltrust" and root is None:
            raise ValueError("aggregation = fltrust needs the server's root update (root)")
        if not -1.0 <= min_cosine <= 1.0:
            raise ValueError(f"min_cosine must be in [-1, 1], got {min_cosine!r}")
        if gate_reference not in GATE_REFERENCES:
            raise ValueError(f"gate_reference must be one of {list(GATE_REFERENCES)}, got "
                             f"{gate_reference!r}")
        if not 0.0 <= gate_memory < 1.0:
            raise ValueError(f"gate_memory must be in [0, 1), got {gate_memory!r}")
        if not -1.0 <= memory_below <= 1.0:
            raise ValueError(f"gate_memory_below must be in [-1, 1], got {memory_below!r}")
        if first_bar is not None and not -1.0 <= first_bar <= 1.0:
            raise ValueError(f"gate_first_bar must be in [-1, 1], got {first_bar!r}")
        if not (math.isfinite(clean_radius) and clean_radius >= 0):
            raise ValueError(f"clean_radius must be a finite number >= 0, got {clean_radius!r}")
        #: ``clip_radius_clean``: centered clipping's radius in a round whose gate left nobody
        #: out (0: ``clip_radius`` in every round).
        self.clean_radius = float(clean_radius)
        self.gate_reference = gate_reference
        self.gate_memory = float(gate_memory)
        #: ``gate_memory_below``: a left-out opens a record only below this cosine.
        self.memory_below = float(memory_below)
        #: ``gate_first_bar``: the bar of a client without an open record (None: min_cosine's;
        #: read only with gate_memory, which keeps the records).
        self.first_bar = None if first_bar is None else float(first_bar)
        #: ``gate_memory``'s record: client key -> its decayed count of left-outs.
        self.record: dict[int, float] = {}
        self.trend: torch.Tensor | None = None  # gate_reference = trend's, flat float64
        self.how, self.trim_fraction = how, float(trim_fraction)
        self.root = root
        self.min_cosine = float(min_cosine)
        self.centered = CenteredClip(clip_radius, clip_iterations, bucket_size, seed)
        self._average = SparseAverage()
        #: The last call's updates the direction gate left out: index -> cosine.
        self.left_out: dict[int, float] = {}
        #: Those of :attr:`left_out` left out for their record alone (their cosine passed).
        self.held_out: set[int] = set()

    @property
    def gated(self) -> bool:
        """Whether the direction gate is on (``min_cosine`` above -1)."""
        return self.min_cosine > -1.0

    def __call__(self, payloads: Sequence[Payload], weights: Sequence[float],
                 factors: Sequence[float], shapes: Mapping[str, tuple[int, ...]],
                 client_keys: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """The round's sum in the space of ``shapes``; ``dgc.AggregationError`` when the
        weights total zero (for fltrust: when no update agrees with the root's).

        ``client_keys``: each payload's client key, for ``gate_memory``'s record (None: no record
        is read or kept, e.g. one combine of a round under central DP)."""
        self.left_out, self.held_out = {}, set()
        if not self.gated:
            return self._combine(payloads, weights, factors, shapes)
        offsets, size = space_offsets(shapes)
        clients = [client_entries(p.parts(), f, offsets)
                   for p, f in zip(payloads, factors, strict=True)]
        reference = self.centered.center_of(size)
        if self.gate_reference == "trend" and self.trend is not None \
                and self.trend.numel() == size:
            reference = self.trend
        elif self.gate_reference == "round" and sum(weights) > 0:
            # This round's clipped combine of every update, from history: its majority's
            # direction. Judged against history alone, a minority let in once turns history
            # its way, and the gate then leaves out the honest clients (issue 35's sign flip).
            reference = self.centered.clip(clients, weights, reference)
        # No reference yet (round 1 judged by history): nothing to judge by, nothing left out.
        judging = bool(reference.any())
        judged = cosines(clients, reference) if judging else [1.0] * len(clients)
        keys = client_keys if self.gate_memory > 0 else None

        def bar(i: int) -> float:
            # A client with no open record must point clearly against the reference to be left
            # out (gate_first_bar); one whose record a clear offence opened, below min_cosine.
            if keys is None or self.first_bar is None or keys[i] in self.record:
                return self.min_cosine
            return self.first_bar

        below = sorted((i for i, cos in enumerate(judged) if cos < bar(i)),
                       key=lambda i: judged[i])
        held = [] if keys is None else sorted(
            (i for i in range(len(judged)) if judged[i] >= self.min_cosine
             and self.record.get(keys[i], 0.0) >= REPEAT_OFFENCES), key=lambda i: judged[i])
        # A minority at most: attackers are fewer than half, so when half or more point against
        # history it is history that turned (EF-sign's round 2 undoes round 1's overshoot), and
        # only the farthest minority is left out; the round always keeps a majority. Those
        # below the bar now go before those held for their record.
        for i in (below + held)[:(len(clients) - 1) // 2]:
            self.left_out[i] = judged[i]
            if i in held:
                self.held_out.add(i)
        if keys is not None:
            self._remember(keys, {keys[i] for i in below if judged[i] < self.memory_below
                                  or keys[i] in self.record})
        keep = [i for i in range(len(clients)) if i not in self.left_out]
        # A round the gate judged and found clean: clip less (half the clients are beyond
        # radius 1, and clipping honest outliers is the robust combine's whole clean-run cost).
        # Not round 1 (nothing judged: a flipper's first update is not known yet), nor where a
        # client of the round has an open record: a flipper whose record decayed under the hold
        # passes the gate, and at the wider radius it pulls twice as hard (issue 35, r35).
        suspect = keys is not None and any(k in self.record for k in keys)
        radius = (self.clean_radius if self.clean_radius > 0 and judging and not self.left_out
                  and not suspect else None)
        out = self._combine([payloads[i] for i in keep], [weights[i] for i in keep],
                            [factors[i] for i in keep], shapes, radius)
        # The gate's trend is kept only while a gate judges by it (plain FedAvg: no work).
        keeps_trend = self.gate_reference == "trend" and self.min_cosine > -1.0
        if self.how == "centered_clip" and not keeps_trend:  # it keeps its own result
            return out
        flat = torch.cat([out[n].reshape(-1).to(torch.float64) for n in shapes])
        if self.how != "centered_clip":
            self.centered.remember(flat)
        if keeps_trend and bool(torch.isfinite(flat).all()):
            self.trend = (flat.clone() if self.trend is None or self.trend.numel() != size
                          else TREND_MOMENTUM * self.trend + (1 - TREND_MOMENTUM) * flat)
        return out

    def _remember(self, clients: Sequence[int], offenders: set[int]) -> None:
        """Decay the record of each client of the round by ``gate_memory`` and count one
        left-out for each of ``offenders`` (below the bar this round, whether or not the
        minority bound let it in; a new record only below ``memory_below``); a record decayed
        below :data:`FORGOTTEN` is dropped (forgotten: the next left-out must open it again)."""
        for key in dict.fromkeys(clients):  # once a round, in the round's order
            value = self.gate_memory * self.record.get(key, 0.0) + (key in offenders)
            if value < FORGOTTEN:
                self.record.pop(key, None)
            else:
                self.record[key] = value

    def _combine(self, payloads: Sequence[Payload], weights: Sequence[float],
                 factors: Sequence[float], shapes: Mapping[str, tuple[int, ...]],
                 radius: float | None = None) -> dict[str, torch.Tensor]:
        if self.how in COORDINATE_WISE:
            return robust_average([p.parts() for p in payloads], list(factors), self.how,
                                  self.trim_fraction, shapes)
        if self.how in ("centered_clip", "fltrust"):
            offsets, size = space_offsets(shapes)
            clients = [client_entries(p.parts(), f, offsets)
                       for p, f in zip(payloads, factors, strict=True)]
            if self.how == "centered_clip":
                return _split(self.centered(clients, list(weights), size, radius), shapes,
                              offsets)
            assert self.root is not None
            return _split(fltrust(clients, self.root(shapes)), shapes, offsets)
        scaled = [w * f for w, f in zip(weights, factors, strict=True)]
        parts = [p.parts() for p in payloads]
        # Each payload's first part, then the others (a client's shared signs) with its weight.
        updates = [ps[0] for ps in parts] + [q for ps in parts for q in ps[1:]]
        ws = scaled + [w for w, ps in zip(scaled, parts, strict=True) for _ in ps[1:]]
        return self.average(updates, ws, float(sum(weights)), shapes)

    def average(self, updates: list[SparseUpdate], weights: list[float], total_weight: float,
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """``sum(w * u) / total_weight`` (:class:`SparseAverage`)."""
        return self._average(updates, weights, total_weight, shapes)

    def state_dict(self) -> dict[str, Any]:
        """What the combine keeps across rounds (centered clipping's center, which the gate
        uses too, and the gate's trend)."""
        if not self._keeps_center:
            return {}
        trend = {"trend": self.trend.clone()} if self.trend is not None else {}
        record = {"gate_record": dict(self.record)} if self.gate_memory > 0 else {}
        return {**self.centered.state_dict(), **trend, **record}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (one without a trend or a record, of before their
        keys: they start again)."""
        if self._keeps_center:
            self.centered.load_state_dict(state)
            trend = state.get("trend")
            self.trend = None if trend is None else torch.as_tensor(trend, dtype=torch.float64)
            record = state.get("gate_record")
            self.record = ({} if record is None or self.gate_memory <= 0 else
                           {int(k): float(v) for k, v in record.items()})

    @property
    def _keeps_center(self) -> bool:
        return self.how == "centered_clip" or self.gated
