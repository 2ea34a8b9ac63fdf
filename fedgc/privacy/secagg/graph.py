"""SecAgg+'s sparse neighbour graph: who shares masks and secrets with whom.

Bell et al. (CCS 2020) replace SecAgg's complete graph by a random k-regular one, a Harary graph
over a random permutation of the clients: client ``i`` of the permutation is joined to the
``k/2`` before and after it on the ring. Each client then agrees masks with, and secret-shares
its seeds among, ``k = O(log n)`` neighbours instead of ``n - 1``, so its work and bytes grow with
``log n``. Flower's ``SecAggPlusWorkflow`` builds the same ring (``num_shares`` neighbours).

How large ``k`` and the threshold ``t`` must be depends on the fraction of clients assumed
corrupt and dropping out (Bell et al. derive the bounds); :func:`default_neighbours` is a
heuristic in the paper's ``O(log n)``, not their bound: pass ``neighbours`` and
``threshold`` for a stated threat model. :func:`default_threshold` is a strict majority of
the neighbours, the least that keeps a server that asks half the neighbours for one kind of
share and half for the other from rebuilding both secrets of one client.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["default_neighbours", "default_threshold", "neighbour_graph"]


def default_neighbours(clients: int) -> int:
    """``2 * ceil(2 * log2 n)`` neighbours (even: a ring has as many on each side), or every
    other client when that is fewer."""
    if clients < 2:
        return 0
    return min(clients - 1, 2 * math.ceil(2 * math.log2(clients)))


def default_threshold(neighbours: int) -> int:
    """A strict majority of ``neighbours``: ``floor(k / 2) + 1``."""
    return neighbours // 2 + 1


def neighbour_graph(clients: Sequence[int], neighbours: int,
                    rng: random.Random | None = None) -> dict[int, tuple[int, ...]]:
    """Each client's neighbours: a Harary ring of ``neighbours`` over a random permutation
    (``rng``: the OS's CSPRNG by default), or the complete graph when ``neighbours`` is
    ``len(clients) - 1``; symmetric, nobody its own neighbour."""
    n = len(clients)
    if neighbours == n - 1:
        return {c: tuple(o for o in clients if o != c) for c in clients}
    if neighbours % 2 or not 0 < neighbours < n - 1:
        raise ValueError(f"neighbours = {neighbours}: a ring of {n} clients takes an even "
                         f"number from 2 to {n - 2}, or {n - 1} (everyone)")
    order = list(clients)
    (rng or random.SystemRandom()).shuffle(order)
    half = neighbours // 2
    return {c: tuple(order[(i + d) % n] for d in range(-half, half + 1) if d)
            for i, c in enumerate(order)}
