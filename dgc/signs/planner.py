"""The sign channel's server half: each round's shared index sets, from the aggregates seen.

The server ranks coordinates by an exponential moving average of its applied aggregates and
picks, per sparsified tensor, the largest ``density`` fraction of them
(:class:`SharedIndexPlanner`). It sends them with the model (:func:`dgc.signs.codec.encode_mask`)
and checkpoints the averages (:meth:`SharedIndexPlanner.state_dict`), so that a resumed server
plans the same sets.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dgc.errors import ConfigError, StateError
from dgc.ranking import top_positions
from dgc.signs.codec import Masks


class SharedIndexPlanner:
    """Picks each round's shared index sets from the aggregates seen so far.

    Parameters
    ----------
    shapes : mapping of str to tuple of int
        The tensors that get a shared index set (the ones clients sparsify) and their shapes.
    density : float
        Fraction of each tensor's entries in its set, in (0, 1].
    small_density : float, default 0.0
        Fraction for tensors of at most ``small_numel`` entries (an output layer); 0 uses
        ``density``.
    small_numel : int, default 10000
        Size limit of the "small" tensors.
    momentum : float, default 0.9
        Factor of the moving average of aggregates that ranks coordinates, in [0, 1): 0 ranks by
        the last aggregate alone; 0.9 keeps about ten rounds of history, which favours
        coordinates that move consistently over single spikes.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], density: float,
                 small_density: float = 0.0, small_numel: int = 10_000,
                 momentum: float = 0.9, churn: float = 1.0) -> None:
        _check_fraction("density", density, allow_zero=False)
        _check_fraction("small_density", small_density, allow_zero=True)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"shared momentum must be in [0, 1), got {momentum!r}")
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self.density = float(density)
        self.small_density = float(small_density)
        self.small_numel = int(small_numel)
        self.momentum = float(momentum)
        _check_fraction("churn", churn, allow_zero=True)
        self.churn = float(churn)
        self.average: dict[str, torch.Tensor] = {}
        self.last: dict[str, np.ndarray] = {}  # the sets of the last plan (with churn < 1)

    def count(self, name: str) -> int:
        """Entries in the shared set of tensor ``name``."""
        numel = math.prod(self.shapes[name])
        small = self.small_density > 0 and numel <= self.small_numel
        return max(1, min(numel, round((self.small_density if small else self.density) * numel)))

    def observe(self, aggregate: Mapping[str, torch.Tensor]) -> None:
        """Fold one applied aggregate (the averaged pseudo-gradient) into the moving average."""
        for name in self.shapes:
            if name not in aggregate:
                continue
            flat = aggregate[name].detach().reshape(-1).to(torch.float32)
            avg = self.average.get(name)
            if avg is None:
                self.average[name] = flat.clone()
            else:
                avg.mul_(self.momentum).add_(flat)

    def plan(self) -> Masks:
        """The next round's index sets (sorted int64); empty before the first aggregate."""
        out: Masks = {}
        for name, avg in self.average.items():
            # topk, not a full sort (~9x faster at 2.5M entries). It is deterministic for equal
            # input, so a resumed server (same averages from the checkpoint) plans the same sets.
            top = torch.topk(avg.abs(), self.count(name), sorted=False).indices
            out[name] = np.sort(top.cpu().numpy()).astype(np.int64)
            if self.churn < 1.0 and name in self.last:
                out[name] = self._limit_churn(avg, self.last[name], out[name])
        if self.churn < 1.0:
            self.last = dict(out)
        return out

    def _limit_churn(self, avg: torch.Tensor, last: np.ndarray, best: np.ndarray) -> np.ndarray:
        """GlueFL's bounded mask shift (He et al. 2023): keep ``last`` but for at most
        ``churn * k`` entries, swapping its weakest members for the strongest newcomers of
        ``best``, so that a client away for rounds needs few new indices."""
        k = len(best)
        score = avg.abs().cpu().numpy()
        newcomers = np.setdiff1d(best, last, assume_unique=True)
        swaps = min(len(newcomers), int(self.churn * k))
        if len(last) != k or swaps == len(newcomers):
            return best
        newcomers = newcomers[np.argsort(-score[newcomers], kind="stable")[:swaps]]
        keep = last[np.argsort(-score[last], kind="stable")[:k - swaps]]
        return np.sort(np.concatenate([keep, newcomers])).astype(np.int64)

    def state_dict(self) -> dict[str, Any]:
        """The moving averages (copies)."""
        return {"average": {n: t.clone() for n, t in self.average.items()},
                "last": {n: torch.from_numpy(m.copy()) for n, m in self.last.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a state for other tensors changes nothing."""
        average = state.get("average") if isinstance(state, Mapping) else None
        if not isinstance(average, Mapping):
            raise StateError("shared planner state must be a mapping with 'average'")
        new = {}
        for name, t in average.items():
            if name not in self.shapes:
                raise StateError(f"shared planner state has unknown tensor {name!r}")
            if not isinstance(t, torch.Tensor) or t.numel() != math.prod(self.shapes[name]):
                raise StateError(f"shared planner state {name!r} must be a tensor of "
                                 f"{math.prod(self.shapes[name])} entries")
            new[name] = t.detach().reshape(-1).to(torch.float32).clone()
        self.average = new
        last = state.get("last") or {}
        self.last = {n: np.asarray(t, dtype=np.int64).copy() for n, t in last.items()
                     if n in self.shapes}


def displacement_masks(model: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor],
                       counts: Mapping[str, int], explore: Mapping[str, int] | None = None,
                       sequence: int = 0) -> Masks:
    """Index sets ranked by how far the model has moved from version 0: per tensor ``name``,
    the ``counts[name]`` entries where ``|model - initial|`` is largest.

    Server and clients hold both models bit for bit (the broadcast model, and version 0 built
    from the run's seed), so both compute the same sets and none travel (``dgc.shared_rank =
    displacement``). Ties go to the lower index (a stable sort), so the sets do not depend on
    the platform's top-k.

    With ``explore`` (per tensor, ``0 <= explore[name] <= counts[name]``), the displacement
    part takes at most ``counts - explore`` entries and only entries that moved; the rest of
    the set is drawn uniformly, without replacement, among the entries it left, by NumPy's
    PCG64 seeded with ``(sequence, crc32(name))`` (the round: both ends draw alike). Why: when
    the model moves only at the sets (secure aggregation holds a client's top-k back), ranking
    by displacement alone picks the same sets every round, and version 0 (nothing moved) none
    worth having; the draw gives the first round a set and the residual's mass elsewhere a way
    out (docs/privacy.md, "dgc_sets under secure aggregation").
    """
    out: Masks = {}
    for name, k in counts.items():
        # On the host: the sets are numpy, and server and client must rank alike.
        now, then = model[name].reshape(-1).cpu(), initial[name].reshape(-1).cpu()
        if now.numel() != then.numel() or not 0 < int(k) <= now.numel():
            raise StateError(f"shared set of {name!r}: {k} entries of a tensor of "
                             f"{now.numel()} (version 0 has {then.numel()})")
        drawn = int(explore.get(name, 0)) if explore else 0
        if not 0 <= drawn <= int(k):
            raise StateError(f"shared set of {name!r}: {drawn} entries drawn at random of a set "
                             f"of {k}; expected 0 to {k}")
        if not explore:
            top = top_positions(now, then, int(k)).numpy()  # the stable sort's first k
        else:
            moved = int((now != then).sum())
            top = top_positions(now, then, min(int(k) - drawn, moved)).numpy()
            rest = int(k) - len(top)
            if rest:
                free = np.setdiff1d(np.arange(now.numel(), dtype=np.int64), top)
                rng = np.random.default_rng([int(sequence), zlib.crc32(name.encode())])
                top = np.concatenate([top, rng.choice(free, rest, replace=False)])
        out[name] = np.sort(top).astype(np.int64)
    return out


def _check_fraction(name: str, value: object, allow_zero: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value) and (0.0 <= value <= 1.0 if allow_zero else 0.0 < value <= 1.0)
    if not ok:
        rng = "[0, 1]" if allow_zero else "(0, 1]"
        raise ConfigError(f"shared {name} must be in {rng}, got {value!r}")
