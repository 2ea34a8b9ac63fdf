"""Batched selection: the top-k of every tensor of a model at once, from one flat buffer, with no
host synchronisation.

On an accelerator the per-tensor selection of :mod:`dgc.selection` is bound by launches and by
host round trips, not by memory traffic: each of ResNet-50's 161 tensors costs a few kernels, and
every data-dependent branch (``if count > k``) or size (``nonzero``) waits for the device. Here
the magnitudes of all sparsified tensors lie back to back in one flat buffer (each tensor a
*segment*) and a constant number of passes over that buffer select every segment's entries:

1. the strided sample of every segment (the same entries :func:`dgc.selection.strided_sample`
   takes) is gathered and sorted by (segment, magnitude descending) in one sort, which gives each
   segment's thresholds for all ``max_adaptations + 1`` attempts at once;
2. one comparison pass and one prefix sum per attempt count each segment's entries at or above
   its threshold; the attempt :func:`dgc.selection.select_sampled` would settle on is then picked
   per segment on the device (a few element-wise operations on one value per segment);
3. the candidates at that threshold are found by binary search in the prefix sum (the r-th
   candidate is where the prefix sum reaches r), into at most ``cap`` slots per segment;
4. one sort by (segment, magnitude descending) keeps each segment's ``k`` largest candidates,
   and one sort by (segment, position) orders them as the wire wants;
5. segments that the sampled selection sends to exact top-k from the start (``s >= n`` or
   ``k >= n``, or ``selection="exact"``) are selected the same way over all their entries.

Every output has a size known on the host before the data exists (``k`` slots per segment, a
validity flag each), so nothing here reads a value back: a caller copies the result to the host
once, when it sends it. A segment whose selection needs what the fixed sizes cannot hold (the
sampled attempts end in the exact fallback, or its candidates overflow their ``cap`` slots) is
flagged in :attr:`Selection.fallback` with no entries; the caller then runs
:func:`dgc.selection.select_exact` on it after that copy (rare: the sampled threshold misses by
``cap / k``, or the sample holds too many zeros).

The entries selected are those of :func:`dgc.selection.select_sampled` and
:func:`dgc.selection.select_exact`, with the same count semantics (at most ``k``, never a zero
entry; in ``[min_count, k]`` for a sampled segment), up to which of several entries of exactly
equal magnitude at the ``k``-th place is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dgc.config import DGCConfig
from dgc.selection import num_selected, sample_size

#: Candidate slots per sampled segment: ``CAP_FACTOR * k + CAP_EXTRA`` (at most its size). The
#: first attempt's threshold is the ``k * s / n``-th largest of the sample, so about ``k``
#: entries pass it; at density 0.001 that rank is 2 or 3 of a 2,000-entry sample, and the count
#: over ``k`` is then about Gamma(2)/2 distributed: above 4 in 0.3% of segments (measured: 0.6%
#: of 2,000 Gaussian segments), above 8 in 2e-6. Past the cap the exact fallback takes over.
CAP_FACTOR, CAP_EXTRA = 8, 256

_LOW31 = 0x7FFFFFFF  # an int32 view of a non-negative float32 is in [0, 0x7F800000]
_VALID_BIT = 1 << 32  # key bit that sorts invalid slots after the valid ones of their segment


@dataclass
class Selection:
    """One batched selection; every tensor has a size fixed by the plan, none needs a sync.

    ``positions[j]`` is the flat position (in the magnitude buffer) of slot ``j``; segment ``t``
    owns slots ``[slot_offsets[t], slot_offsets[t] + k[t])``, its ``counts[t]`` valid ones first,
    in increasing position. Invalid slots hold some position inside the buffer (never read as a
    selection). ``fallback[t]``: segment ``t`` has no slots filled and needs the exact selection.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor
    fallback: torch.Tensor
    slot_segment: torch.Tensor


class BatchedSelector:
    """The plan and the device-side constants for one set of segment sizes at one density.

    Built on the host (once per layout and density; the compressor keeps them); :meth:`select`
    then runs without host synchronisation.

    Parameters
    ----------
    sizes : sequence of int
        Entries of each segment, in the order they lie in the flat buffer (no gaps).
    density : float
        The density this step sends (``k = num_selected(n, density)`` per segment).
    config : DGCConfig
        ``selection``, ``sample_ratio``, ``min_count_ratio`` and ``max_adaptations`` are used.
    device : torch.device
        Where the buffers live.
    """

    def __init__(self, sizes: Sequence[int], density: float, config: DGCConfig,
                 device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.sizes = tuple(int(n) for n in sizes)
        self.numel = sum(self.sizes)
        self.offsets = tuple(_exclusive_cumsum(self.sizes))
        self.ks = tuple(num_selected(n, density) for n in self.sizes)
        self.slot_offsets = tuple(_exclusive_cumsum(self.ks))
        self.num_slots = sum(self.ks)
        self._cs_dtype = torch.int32 if self.numel < 2**31 - 1 else torch.int64
        exact: list[int] = []
        sampled: list[int] = []
        samples: list[int] = []
        for t, n in enumerate(self.sizes):
            k = self.ks[t]
            s = sample_size(n, density, config.sample_ratio)
            if config.selection == "exact" or k >= n or s >= n:
                exact.append(t)
            else:
                sampled.append(t)
                samples.append(s)
        self.exact_segments = tuple(exact)
        self.sampled_segments = tuple(sampled)
        dev = self.device
        self._seg_of_slot = torch.repeat_interleave(
            torch.arange(len(self.sizes), dtype=torch.int64),
            torch.tensor(self.ks, dtype=torch.int64)).to(dev)
        self._offsets = torch.tensor(self.offsets, dtype=torch.int64).to(dev)
        self._segment_of_entry: torch.Tensor | None = None  # built when a segment is sampled
        self._exact_plan(exact)
        self._sampled_plan(sampled, samples, density, config)

    # ------------------------------------------------------------------ plans (host side)
    def _exact_plan(self, exact: list[int]) -> None:
        """Where the exact segments' entries are and where their top-k lands in the output."""
        self._exact = None
        if not exact:
            return
        dev = self.device
        sizes = [self.sizes[t] for t in exact]
        whole = exact == list(range(len(self.sizes)))
        positions = None
        if not whole:  # gather them out of the buffer; they are the small tensors, as a rule
            positions = torch.cat([torch.arange(self.offsets[t], self.offsets[t] + self.sizes[t],
                                                dtype=torch.int64) for t in exact]).to(dev)
        local_offsets = _exclusive_cumsum(sizes)
        top = torch.cat([torch.arange(o, o + self.ks[t], dtype=torch.int64)
                         for o, t in zip(local_offsets, exact, strict=True)]).to(dev)
        out = torch.cat([torch.arange(self.slot_offsets[t], self.slot_offsets[t] + self.ks[t],
                                      dtype=torch.int64) for t in exact]).to(dev)
        segment = torch.repeat_interleave(torch.arange(len(exact), dtype=torch.int64),
                                          torch.tensor(sizes, dtype=torch.int64)).to(dev)
        self._exact = (positions, segment, top, out)

    def _sampled_plan(self, sampled: list[int], samples: list[int], density: float,
                      config: DGCConfig) -> None:
        """The sample positions, the threshold ranks of every attempt and the candidate slots
        of the sampled segments (the constants of :func:`dgc.selection.select_sampled`)."""
        self._sampled = None
        if not sampled:
            return
        dev = self.device
        attempts = config.max_adaptations + 1
        strides, sample_base, ranks, rank_full, reached, min_counts, caps = [], [], [], [], [], \
            [], []
        sample_offsets = _exclusive_cumsum(samples)
        for t, s, s_off in zip(sampled, samples, sample_offsets, strict=True):
            n, k = self.sizes[t], self.ks[t]
            stride = max(1, n // s)
            strides.append(stride)
            sample_base.append(torch.arange(s, dtype=torch.int64) * stride + self.offsets[t])
            k_sample = max(1, math.ceil(k * s / n))
            row = [min(s, k_sample << a) for a in range(attempts)]
            # Attempt a is made only while the previous one's rank was below s.
            reached.append([a == 0 or row[a - 1] < s for a in range(attempts)])
            ranks.append([s_off + r - 1 for r in row])
            rank_full.append([r == s for r in row])
            min_counts.append(max(1, math.ceil(config.min_count_ratio * k)))
            caps.append(min(n, CAP_FACTOR * k + CAP_EXTRA))
        # Each entry's segment, to spread per-segment thresholds over the buffer: 4 bytes an
        # entry kept, against rebuilding it in every pass (repeat_interleave was 60% of a step).
        self._segment_of_entry = torch.repeat_interleave(
            torch.arange(len(self.sizes), dtype=torch.int32),
            torch.tensor(self.sizes, dtype=torch.int64)).to(dev)
        cap_offsets = _exclusive_cumsum(caps)
        ks = [self.ks[t] for t in sampled]
        segment_sample = torch.repeat_interleave(torch.arange(len(sampled), dtype=torch.int64),
                                                 torch.tensor(samples, dtype=torch.int64))
        segment_cap = torch.repeat_interleave(torch.arange(len(sampled), dtype=torch.int64),
                                              torch.tensor(caps, dtype=torch.int64))
        within_cap = torch.arange(sum(caps), dtype=torch.int64) - torch.tensor(
            cap_offsets, dtype=torch.int64)[segment_cap]
        top = torch.cat([torch.arange(o, o + k, dtype=torch.int64)
                         for o, k in zip(cap_offsets, ks, strict=True)])
        out = torch.cat([torch.arange(self.slot_offsets[t], self.slot_offsets[t] + self.ks[t],
                                      dtype=torch.int64) for t in sampled])
        offsets = torch.tensor([self.offsets[t] for t in sampled], dtype=torch.int64)
        ends = offsets + torch.tensor([self.sizes[t] for t in sampled], dtype=torch.int64)
        # The threshold of a segment that is not sampled (exact) is +inf: no candidates there.
        self._sampled = {
            "index": torch.tensor(sampled, dtype=torch.int64).to(dev),
            "strides": torch.tensor(strides, dtype=torch.int64).to(dev),
            "sample_base": torch.cat(sample_base).to(dev),
            "segment_sample": segment_sample.to(dev),
            "ranks": torch.tensor(ranks, dtype=torch.int64).to(dev),
            "rank_full": torch.tensor(rank_full, dtype=torch.bool).to(dev),
            "reached": torch.tensor(reached, dtype=torch.bool).to(dev),
            "min_counts": torch.tensor(min_counts, dtype=torch.int64).to(dev),
            "ks": torch.tensor(ks, dtype=torch.int64).to(dev),
            "caps": torch.tensor(caps, dtype=torch.int64).to(dev),
            "starts": offsets.to(dev),
            "ends": ends.to(dev),
            "segment_cap": segment_cap.to(dev),
            "within_cap": within_cap.to(dev),
            "top": top.to(dev),
            "out": out.to(dev),
            "attempts": attempts,
        }

    # ------------------------------------------------------------------ the hot path
    def select(self, magnitude: torch.Tensor, step: int) -> Selection:
        """Select every segment's entries of the flat non-negative ``magnitude`` buffer.

        ``step`` offsets the strided samples as :func:`dgc.selection.select_sampled`'s
        ``offset`` does. No host synchronisation: every size is the plan's.
        """
        dev = magnitude.device
        positions = torch.zeros(self.num_slots, dtype=torch.int64, device=dev)
        valid = torch.zeros(self.num_slots, dtype=torch.bool, device=dev)
        fallback = torch.zeros(len(self.sizes), dtype=torch.bool, device=dev)
        if self._exact is not None:
            pos, ok = self._select_exact(magnitude)
            out = self._exact[3]
            positions.index_copy_(0, out, pos)
            valid.index_copy_(0, out, ok)
        if self._sampled is not None:
            pos, ok, flag = self._select_sampled(magnitude, step)
            out = self._sampled["out"]
            positions.index_copy_(0, out, pos)
            valid.index_copy_(0, out, ok)
            fallback.index_copy_(0, self._sampled["index"], flag)
        # Valid slots first, each segment in increasing position (what the wire wants).
        local = positions - self._offsets[self._seg_of_slot]
        key = (self._seg_of_slot << 33) + (~valid).to(torch.int64) * _VALID_BIT + local
        order = torch.sort(key).indices
        positions, valid = positions[order], valid[order]
        counts = torch.zeros(len(self.sizes), dtype=torch.int64, device=dev)
        counts.index_add_(0, self._seg_of_slot, valid.to(torch.int64))
        return Selection(positions, valid, counts, fallback, self._seg_of_slot)

    def _select_exact(self, magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact segments' top-k: one sort by (segment, magnitude descending)."""
        positions, segment, top, _ = self._exact
        values = magnitude if positions is None else magnitude[positions]
        order = _segment_descending(values, segment)
        chosen = order[top]
        ok = values[chosen] > 0
        return (chosen if positions is None else positions[chosen]), ok

    def _select_sampled(self, magnitude: torch.Tensor,
                        step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampled segments' selection (steps 1-4 of the module docstring)."""
        p = self._sampled
        dev = magnitude.device
        # 1. Every segment's strided sample, sorted by (segment, magnitude descending).
        starts = torch.remainder(torch.full_like(p["strides"], step), p["strides"])
        sample = magnitude[p["sample_base"] + starts[p["segment_sample"]]]
        ordered = sample[_segment_descending(sample, p["segment_sample"])]
        thresholds = ordered[p["ranks"]]  # (segments, attempts)
        # 2. Each attempt's count, and the attempt select_sampled settles on.
        counts = torch.stack([self._count_at(magnitude, thresholds[:, a])
                              for a in range(p["attempts"])], dim=1)
        chosen = torch.zeros_like(thresholds[:, 0])
        chosen_count = torch.zeros_like(counts[:, 0])
        decided = torch.zeros_like(p["reached"][:, 0])
        exact = torch.zeros_like(decided)
        for a in range(p["attempts"]):
            live = p["reached"][:, a] & ~decided
            threshold, count = thresholds[:, a], counts[:, a]
            nothing = live & (threshold <= 0)  # the sample is mostly zeros: exact top-k
            live = live & ~nothing
            take = live & (count >= p["min_counts"])  # above k is trimmed to the k largest
            full = live & ~take & p["rank_full"][:, a]  # the whole sample used: exact top-k
            chosen = torch.where(take, threshold, chosen)
            chosen_count = torch.where(take, count, chosen_count)
            exact = exact | nothing | full
            decided = decided | nothing | take | full
        exact = exact | ~decided  # every attempt fell short
        fallback = exact | (chosen_count > p["caps"])
        chosen = torch.where(fallback, torch.full_like(chosen, math.inf), chosen)
        # 3. The candidates at the chosen threshold, by binary search in the prefix count.
        cumulative = self._cumulative_at(magnitude, chosen)
        before = torch.where(p["starts"] > 0, cumulative[(p["starts"] - 1).clamp(min=0)],
                             torch.zeros_like(cumulative[:1]))
        taken = torch.where(fallback, torch.zeros_like(chosen_count), chosen_count)
        rank = before[p["segment_cap"]].to(torch.int64) + 1 + p["within_cap"]
        candidate = torch.searchsorted(cumulative, rank.to(cumulative.dtype))
        candidate = candidate.clamp(max=max(self.numel - 1, 0))
        ok = p["within_cap"] < taken[p["segment_cap"]]
        values = torch.where(ok, magnitude[candidate], torch.zeros((), device=dev))
        # 4. The k largest candidates of each segment (all of them when there are at most k).
        order = _segment_descending(values, p["segment_cap"])
        kept = order[p["top"]]
        return candidate[kept], values[kept] > 0, fallback

    def _threshold_per_entry(self, thresholds: torch.Tensor) -> torch.Tensor:
        """Each entry's segment threshold (``+inf`` in the exact segments)."""
        p = self._sampled
        every = torch.full((len(self.sizes),), math.inf, dtype=thresholds.dtype,
                           device=thresholds.device)
        every = every.index_copy(0, p["index"], thresholds)
        return every.index_select(0, self._segment_of_entry)

    def _cumulative_at(self, magnitude: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """Running count of the entries at or above their segment's threshold."""
        passing = magnitude >= self._threshold_per_entry(thresholds)
        return torch.cumsum(passing, dim=0, dtype=self._cs_dtype)

    def _count_at(self, magnitude: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """Entries at or above their segment's threshold, per sampled segment."""
        p = self._sampled
        cumulative = self._cumulative_at(magnitude, thresholds)
        end = cumulative[p["ends"] - 1]
        before = torch.where(p["starts"] > 0, cumulative[(p["starts"] - 1).clamp(min=0)],
                             torch.zeros_like(end))
        return (end - before).to(torch.int64)


def _segment_descending(values: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """The order that sorts ``values`` (>= 0, float32) by segment, then by value descending,
    ties in increasing position: one sort of int64 keys."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    key = (segment << 31) + (_LOW31 - bits)
    return torch.sort(key, stable=True).indices


def _exclusive_cumsum(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out
