"""Robust statistics of a round's sparse payloads that keep state or data of the server's own:
centered clipping (with its center carried over rounds) and FLTrust (with a root update).

Both are combine statistics (:class:`server.aggregation.Combine`, ``aggregation =
centered_clip | fltrust``), so every method gets them: they read a payload only through its
``parts()`` in the aggregator's space, as the mean and the coordinate-wise statistics do. A
client's entries are gathered once (its parts summed where they overlap, times its clip factor)
and never densified: each step is O(its nonzeros) per client, plus O(space) per step for the
server's own dense vectors (the center, the root update, the result).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import dgc
from dgc import SparseUpdate
from fedgc.schema import SettingsError
from fedgc.task_loader import load_task
from fedgc.training import round_seed, train_locally

__all__ = ["CenteredClip", "ClientEntries", "RootUpdate", "buckets", "client_entries", "cosines",
           "fltrust", "space_offsets"]

#: One client's entries in the flat space: (sorted unique positions, float64 values).
ClientEntries = tuple[torch.Tensor, torch.Tensor]


def space_offsets(shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """Where each tensor starts in the space flattened tensor after tensor, and the total."""
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += math.prod(shape)
    return offsets, total


def _flat(update: SparseUpdate, offsets: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the flat space, values) of a decoded update's entries."""
    if update.packed is not None:
        p = update.packed
        if p.layout.names == tuple(offsets):
            dense = [torch.arange(off, off + n) for off, n, is_dense in
                     zip(p.layout.offsets, p.counts, p.layout.dense, strict=True) if is_dense]
            return (torch.cat([p.sparse_indices.to(torch.int64), *dense]),
                    torch.cat([p.sparse_values, p.dense_values]).to(torch.float64))
    idx = [t.indices.to(torch.int64) + offsets[n] for n, t in update.tensors.items()]
    val = [t.values.to(torch.float64) for t in update.tensors.values()]
    if not idx:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    return torch.cat(idx), torch.cat(val)


def client_entries(parts: Sequence[SparseUpdate], factor: float,
                   offsets: Mapping[str, int]) -> ClientEntries:
    """A client's parts, summed where they overlap and scaled by ``factor`` (its norm clip),
    as one sparse vector of the flat space."""
    flat = [_flat(u, offsets) for u in parts]
    idx = torch.cat([f[0] for f in flat])
    val = torch.cat([f[1] for f in flat]) * float(factor)
    idx, inverse = torch.unique(idx, return_inverse=True)  # one value per coordinate
    return idx, torch.zeros(idx.numel(), dtype=torch.float64).index_add_(0, inverse, val)


def _distances(clients: Sequence[ClientEntries], center: torch.Tensor) -> list[float]:
    """||x_i - v|| for each sparse x_i and the dense v, each in O(its nonzeros):
    ||v||^2 - ||v_S||^2 + ||x_S - v_S||^2 over its support S."""
    total = float(center.square().sum())
    out = []
    for idx, val in clients:
        at = center[idx]
        out.append(math.sqrt(max(total - float(at.square().sum())
                                 + float((val - at).square().sum()), 0.0)))
    return out


def buckets(clients: Sequence[ClientEntries], weights: Sequence[float], size: int,
            generator: torch.Generator) -> tuple[list[ClientEntries], list[float]]:
    """Bucketing (Karimireddy, He and Jaggi, "Byzantine-Robust Learning on Heterogeneous
    Datasets via Bucketing", ICLR 2022): the clients in a random order (``generator``), cut
    into buckets of ``size`` (the last one may be smaller), each bucket the weighted mean of its
    clients with their weights' sum as its weight. A robust combine then sees bucket means,
    closer to one another than the clients of skewed partitions are, so it clips fewer honest
    ones; a hostile client's pull is diluted by its bucket's others. Sparse: a bucket's entries
    are the union of its clients' positions."""
    order = torch.randperm(len(clients), generator=generator).tolist()
    out, out_weights = [], []
    for start in range(0, len(order), size):
        members = order[start:start + size]
        total = float(sum(weights[i] for i in members))
        if total <= 0:
            continue
        idx = torch.cat([clients[i][0] for i in members])
        val = torch.cat([clients[i][1] * (float(weights[i]) / total) for i in members])
        idx, inverse = torch.unique(idx, return_inverse=True)
        out.append((idx, torch.zeros(idx.numel(), dtype=torch.float64)
                    .index_add_(0, inverse, val)))
        out_weights.append(total)
    return out, out_weights


class CenteredClip:
    """Centered clipping (Karimireddy, He and Jaggi, "Learning from History for Byzantine
    Robust Optimization", ICML 2021), weighted, with a radius relative to the round.

    1. Start from the center ``v``: the previous round's combined aggregate (the server's
       "momentum" of the paper: an honest estimate from history), 0 in round 1.
    2. ``iterations`` times: ``tau = radius_ratio * median_i ||x_i - v||``;
       ``v <- v + sum_i w_i min(1, tau / ||x_i - v||) (x_i - v) / sum_i w_i``.
    3. The result is the round's aggregate and the next round's center.

    A client moves ``v`` by at most its weight share times ``tau`` per iteration, whatever it
    sends; with no client beyond ``tau`` a step is exactly the weighted mean (FedAvg). The
    radius follows the round's median distance, so it needs no tuning per task, and a minority
    cannot widen it. Each iteration costs O(space) for ``v`` and O(nonzeros) per client.

    ``bucket_size`` above 1 clips bucket means instead of clients (:func:`buckets`), in an
    order drawn from ``seed`` and the number of rounds combined so far (kept in the
    checkpoint, so a resumed run draws what the uninterrupted one would).
    """

    def __init__(self, radius_ratio: float = 1.0, iterations: int = 3, bucket_size: int = 1,
                 seed: int = 0) -> None:
        if not (math.isfinite(radius_ratio) and radius_ratio > 0):
            raise ValueError(f"radius_ratio must be a finite number > 0, got {radius_ratio!r}")
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be an integer >= 1, got {bucket_size!r}")
        self.radius_ratio, self.iterations = float(radius_ratio), int(iterations)
        self.bucket_size, self.seed = bucket_size, int(seed)
        self.center: torch.Tensor | None = None  # flat float64, the space's size
        self.draws = 0  # rounds bucketed so far: the next order's seed

    def __call__(self, clients: Sequence[ClientEntries], weights: Sequence[float],
                 size: int, radius_ratio: float | None = None) -> torch.Tensor:
        """The round's aggregate (flat float64 of ``size``), kept as the next round's center;
        ``dgc.AggregationError`` when the weights total zero. ``radius_ratio``: this round's
        radius instead of the one kept (a round the gate found clean:
        :class:`server.aggregation.Combine`)."""
        total = float(sum(weights))
        if not clients or total <= 0:
            raise dgc.AggregationError("total weight is zero; nothing to aggregate")
        if self.bucket_size > 1:
            # Seeded per round, not by a generator carried along: the state is one counter.
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.draws)
            self.draws += 1
            clients, weights = buckets(clients, weights, self.bucket_size, generator)
        v = self.clip(clients, weights, self.center_of(size), radius_ratio)
        self.remember(v)
        return v

    def clip(self, clients: Sequence[ClientEntries], weights: Sequence[float],
             center: torch.Tensor, radius_ratio: float | None = None) -> torch.Tensor:
        """Step 2 of the algorithm from ``center`` (unchanged; nothing kept, nothing drawn):
        the clipped weighted combine of ``clients`` (weights totalling above 0), at
        ``radius_ratio`` (None: the one kept)."""
        ratio = self.radius_ratio if radius_ratio is None else float(radius_ratio)
        total = float(sum(weights))
        shares = [float(w) / total for w in weights]
        v = center.clone()
        for _ in range(self.iterations):
            dist = _distances(clients, v)
            tau = ratio * statistics.median(dist)
            scale = [s * (1.0 if d <= tau or d == 0 else tau / d)
                     for s, d in zip(shares, dist, strict=True)]
            # v + sum_i a_i (x_i - v) = (1 - sum_i a_i) v + sum_i a_i x_i: one O(space) step.
            new = v * (1.0 - sum(scale))
            for (idx, val), a in zip(clients, scale, strict=True):
                if a:
                    new.index_add_(0, idx, val * a)
            v = new
        return v

    def center_of(self, size: int) -> torch.Tensor:
        """The center kept (flat float64 of ``size``): the last round's aggregate, 0 before
        the first or when the space changed size."""
        if self.center is not None and self.center.numel() == size:
            return self.center
        return torch.zeros(size, dtype=torch.float64)

    def remember(self, aggregate: torch.Tensor) -> None:
        """Keep ``aggregate`` (flat float64) as the next round's center, if it is finite."""
        if torch.isfinite(aggregate).all():
            self.center = aggregate.clone()

    def state_dict(self) -> dict[str, Any]:
        """The center and the bucketing draws, for the checkpoint."""
        return {"center": None if self.center is None else self.center.clone(),
                "draws": self.draws}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (one of before bucketing: no draws yet)."""
        center = state.get("center")
        self.center = None if center is None else torch.as_tensor(center, dtype=torch.float64)
        self.draws = int(state.get("draws", 0))


def cosines(clients: Sequence[ClientEntries], reference: torch.Tensor) -> list[float]:
    """``cos(x_i, reference)`` for each sparse ``x_i`` and the dense ``reference``, each in
    O(its nonzeros); 0 where either is zero."""
    ref_norm = float(reference.norm())
    out = []
    for idx, val in clients:
        norm = float(val.norm())
        out.append(float(val @ reference[idx]) / (norm * ref_norm) if norm and ref_norm
                   else 0.0)
    return out


def fltrust(clients: Sequence[ClientEntries], root: torch.Tensor) -> torch.Tensor:
    """FLTrust (Cao, Fang, Liu and Gong, NDSS 2021): each client's update is rescaled to the
    norm of the server's own update on its root set (``root``, flat, dense) and weighted by
    its trust score ``ReLU(cos(x_i, root))``; the weighted mean of the rescaled updates.

    Claimed weights are ignored (the scores replace them). ``dgc.AggregationError`` when no
    client scores above zero (every update points away from the root's), or the root update is
    zero.
    """
    root_norm = float(root.norm())
    if not math.isfinite(root_norm) or root_norm == 0:
        raise dgc.AggregationError("the server's root update is zero or not finite")
    out = torch.zeros(root.numel(), dtype=torch.float64)
    total = 0.0
    for idx, val in clients:
        norm = float(val.norm())
        if norm == 0:
            continue
        trust = max(float(val @ root[idx]) / (norm * root_norm), 0.0)
        if trust > 0:
            out.index_add_(0, idx, val * (trust * root_norm / norm))
            total += trust
    if total <= 0:
        raise dgc.AggregationError("no update agrees with the server's root update "
                                   "(every trust score is 0)")
    return out / total


class RootUpdate:
    """FLTrust's root update: the server's own round of local training, from the model clients
    were sent, on ``root_samples`` examples of the task's training split (seeded by the run's
    seed, the same every round), with the clients' training keys (lr, batch, epochs or steps,
    momentum, weight decay). A client round run by the server: it trains with the clients' own
    function (``fedgc.training``), so the two are computed alike.

    FLTrust compares updates with the root update in the model's space only: a method whose
    aggregator works in a space of its own (``Aggregator.space``) is refused.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.task = load_task(config.train.task_spec())  # the server's own config: trusted
        n = int(self.task.train_x.shape[0])
        count = min(int(config.server.root_samples), n)
        generator = torch.Generator().manual_seed(int(config.train.seed) + 26)
        self.rows = torch.randperm(n, generator=generator)[:count]
        self._model: torch.nn.Module | None = None

    def __call__(self, model: Mapping[str, torch.Tensor], server_round: int,
                 space: Mapping[str, tuple[int, ...]]) -> torch.Tensor:
        """The root update from ``model`` in round ``server_round``, flat float64 over
        ``space`` (which must be the model's)."""
        shapes = {k: tuple(v.shape) for k, v in model.items()}
        if dict(space) != shapes:
            raise SettingsError("aggregation = fltrust compares updates with the server's own "
                                "in the model's space; this method aggregates in a space of "
                                "its own (Aggregator.space): choose another aggregation")
        if self._model is None:
            self._model = self.task.build_model()
        self._model.load_state_dict(dict(model), strict=False)
        t = self.config.train
        x, y = self.task.train_x[self.rows], self.task.train_y[self.rows]
        result = train_locally(self._model, x, y, self.task.training_loss, lr=t.lr,
                               batch_size=t.batch_size, local_epochs=t.local_epochs,
                               local_steps=t.local_steps, momentum=t.client_momentum,
                               weight_decay=t.weight_decay,
                               seed=round_seed(t.seed, server_round, t.num_clients))
        offsets, size = space_offsets(shapes)
        out = torch.zeros(size, dtype=torch.float64)
        for name, offset in offsets.items():
            out[offset:offset + math.prod(shapes[name])] = (
                result.pseudo_gradient[name].reshape(-1).to(torch.float64))
        return out
