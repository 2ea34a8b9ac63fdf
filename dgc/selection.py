"""Top-k selection of the largest magnitudes: exact, and by a sampled threshold (paper, Sec. 3.4).

Both functions return sorted flat int64 indices of at most ``k`` entries, never an entry whose value
is zero, and at least one entry for any tensor that has a non-zero entry.
"""

from __future__ import annotations

import math

import torch


def num_selected(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` entries at ``density``: at least 1, at most ``numel``."""
    return min(numel, max(1, math.ceil(numel * density)))


_WORD = 8  # bools per int64 word
_WORDS_FROM = 1 << 16  # below this, plain nonzero is as fast


def nonzero_flat(mask: torch.Tensor) -> torch.Tensor:
    """Sorted flat int64 positions of the True entries of a flat bool tensor.

    For a large, sparse mask it scans 8 entries at a time, reading the mask as int64 words and
    looking inside only the non-zero words: several times faster than ``torch.nonzero`` of the
    whole mask, which dominates the sampled selection's cost otherwise. Same result either way.
    """
    n = mask.numel()
    body = n - n % _WORD
    if n < _WORDS_FROM or not mask.is_contiguous() or mask.storage_offset() % _WORD:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask[:body].view(torch.int64)).view(-1)
    hits = torch.nonzero(mask[:body].view(-1, _WORD)[words])
    found = words[hits[:, 0]] * _WORD + hits[:, 1]
    if body == n:
        return found
    return torch.cat([found, torch.nonzero(mask[body:]).view(-1) + body])


def select_exact(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of a flat non-negative tensor, sorted, zeros dropped."""
    n = magnitude.numel()
    if k >= n:
        idx = torch.arange(n, dtype=torch.int64, device=magnitude.device)
    else:
        idx = torch.topk(magnitude, k, sorted=False).indices
    idx = idx[magnitude[idx] > 0]
    return torch.sort(idx).values


def select_stable(values: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted flat int64 positions of the ``k`` largest entries of a flat tensor, ties going to
    the lower position: the set ``torch.sort(values, descending=True, stable=True).indices[:k]``
    holds, found without sorting every entry. ValueError if ``values`` holds a NaN (no order).

    A top-k of ``k + 1`` entries holds every entry above its smallest. When that smallest is
    below every other (no tie straddles the ``k``-th entry), the other ``k`` are the set, at
    the cost of the top-k and a sort of ``k`` positions; otherwise the entries above the
    ``k``-th value are in, and the first entries equal to it in position order fill the rest.
    The set does not depend on the platform's top-k (which breaks ties as it likes), and on a
    6.5M-entry model it costs a tenth of the stable sort (docs/tasks.md, "A phone-sized
    model").
    """
    n = values.numel()
    if k >= n:
        if n and bool(torch.isnan(values).any()):
            raise ValueError(f"the values hold NaN at {_first_nan(values)}: no order to pick "
                             f"the {k} largest by")
        return torch.arange(n, dtype=torch.int64, device=values.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=values.device)
    top, idx = torch.topk(values, k + 1, sorted=False)
    least, at = top.min(0)
    if bool(torch.isnan(least)):  # torch.topk ranks NaN above every number: it is in the top
        raise ValueError(f"the values hold NaN at {_first_nan(values)}: no order to pick the "
                         f"{k} largest by")
    at_least = top == least
    if int(torch.count_nonzero(at_least)) == 1:  # no tie at the k-th: the (k+1)-th is below
        idx[at] = idx[k]  # the last entry takes the (k+1)-th's place; the first k are the set
        return torch.sort(idx[:k]).values
    # The k-th value is the (k+1)-th's (``least``): a tie straddles the cut.
    above = idx[~at_least]
    return torch.sort(torch.cat([above, _first_equal(values, least, k - above.numel())])).values


def _first_equal(values: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` positions of the flat ``values`` equal to ``target`` (there are as
    many), read in chunks that double: ties near the start cost a pass over the start only."""
    found, have, start, size = [], 0, 0, max(4096, 4 * count)
    while have < count:
        hits = torch.nonzero(values[start:start + size] == target).view(-1) + start
        found.append(hits)
        have, start, size = have + hits.numel(), start + size, 2 * size
    return torch.cat(found)[:count]


def _first_nan(values: torch.Tensor) -> int:
    return int(torch.nonzero(torch.isnan(values))[0, 0])


def sample_size(numel: int, density: float, sample_ratio: float) -> int:
    """Entries in the threshold sample: ``max(sample_ratio * n, 2 / density)``, capped at ``n``."""
    return min(numel, max(math.ceil(numel * sample_ratio), math.ceil(2.0 / density)))


def strided_sample(magnitude: torch.Tensor, size: int, offset: int = 0) -> torch.Tensor:
    """A deterministic sample of ``size`` entries taken with a constant stride.

    The offset changes from step to step (the caller passes its step counter) so that a tensor
    whose large entries fall on a regular grid is not always sampled at the same positions.
    ``torch.randint`` would do as well in eager mode but does not export to ExecuTorch.
    """
    n = magnitude.numel()
    stride = max(1, n // size)
    start = offset % stride
    return magnitude[start::stride][:size]


def select_sampled(
    magnitude: torch.Tensor,
    k: int,
    density: float,
    sample_ratio: float = 0.01,
    min_count_ratio: float = 0.5,
    max_adaptations: int = 2,
    offset: int = 0,
) -> torch.Tensor:
    """Indices of about the ``k`` largest entries, found by a threshold estimated on a sample.

    1. Take a strided sample and the threshold of its own top ``k * s / n`` entries.
    2. Select every entry at or above the threshold in one comparison pass.
    3. Too many: keep the ``k`` largest of the selection (exact, on the small candidate set).
       Too few (under ``min_count_ratio * k``): lower the threshold to the next sample quantile,
       at most ``max_adaptations`` times, then fall back to exact top-k on the whole tensor.
    """
    n = magnitude.numel()
    s = sample_size(n, density, sample_ratio)
    if k >= n or s >= n:
        return select_exact(magnitude, k)
    sample = strided_sample(magnitude, s, offset)
    k_sample = max(1, math.ceil(k * s / n))
    min_count = max(1, math.ceil(min_count_ratio * k))
    for attempt in range(max_adaptations + 1):
        # Each attempt doubles the number of sample entries above the threshold.
        rank = min(s, k_sample << attempt)
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        if threshold <= 0:
            break
        candidates = nonzero_flat(magnitude >= threshold)
        count = candidates.numel()
        if count > k:
            top = torch.topk(magnitude[candidates], k, sorted=False).indices
            return torch.sort(candidates[top]).values
        if count >= min_count:
            return candidates
        if rank == s:
            break
    return select_exact(magnitude, k)
