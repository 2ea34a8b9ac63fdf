"""The local minibatch order of a simulated client, reproduced without torch: MT19937 and randperm.

``fedgc.training.train_locally`` shuffles a client's examples with
``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` once per epoch, and takes
batches of ``batch_size`` in that order (the last one of an epoch may be smaller). A phone that
trains on the same examples in the same order, with the same optimizer, runs the same round
(``docs/android.md``, "A phone runs a simulated client's round"), so it must draw the same
permutations. Torch's CPU generator is the 32-bit Mersenne Twister (MT19937) seeded with the
low 32 bits of the seed (the reference ``init_genrand``), and ``randperm`` for ``n`` below
2**32 / 20 is a Fisher-Yates shuffle that swaps entry ``i`` with entry ``i + (r mod (n - i))``
for ``i = 0 .. n - 2``, one 32-bit draw ``r`` per swap; successive permutations continue the
same stream. Both are a few lines in any language: this module is the specification for a phone
(``android_bridge/android/``) as much as the reference phone's code.

``tests/test_phone_parity.py`` checks it against ``torch.randperm`` draw for draw.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

__all__ = ["MT19937", "local_batches", "randperm"]

_N, _M = 624, 397
_UPPER, _LOWER = np.uint32(0x80000000), np.uint32(0x7FFFFFFF)
_MATRIX_A = np.uint32(0x9908B0DF)


class MT19937:
    """The 32-bit Mersenne Twister (Matsumoto and Nishimura, 1998) seeded as ``init_genrand``.

    Parameters
    ----------
    seed : int
        Any integer; its low 32 bits seed the generator, as ``torch.Generator.manual_seed``.
    """

    def __init__(self, seed: int) -> None:
        state = np.empty(_N, dtype=np.uint64)
        state[0] = seed & 0xFFFFFFFF
        for i in range(1, _N):
            prev = int(state[i - 1])
            state[i] = (1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF
        self._state = state.astype(np.uint32)
        self._index = _N

    def _twist(self) -> None:
        s = self._state
        # The recurrence reads s[i + 1] (not yet renewed) and s[(i + M) mod N], renewed by then
        # when i >= N - M: in runs of N - M entries, so that each run reads only entries the
        # sequential loop would already have renewed, or not yet touched.
        step = _N - _M
        for lo, hi in ((0, step), (step, 2 * step), (2 * step, _N - 1)):
            y = (s[lo:hi] & _UPPER) | (s[lo + 1:hi + 1] & _LOWER)
            src = s[lo + _M:hi + _M] if hi + _M <= _N else s[lo + _M - _N:hi + _M - _N]
            s[lo:hi] = src ^ (y >> np.uint32(1)) ^ np.where(y & np.uint32(1), _MATRIX_A,
                                                            np.uint32(0))
        y = (s[_N - 1] & _UPPER) | (s[0] & _LOWER)
        s[_N - 1] = s[_M - 1] ^ (y >> np.uint32(1)) ^ (_MATRIX_A if y & 1 else np.uint32(0))
        self._index = 0

    def draws(self, count: int) -> np.ndarray:
        """The next ``count`` 32-bit outputs (tempered), as uint32."""
        out = np.empty(count, dtype=np.uint32)
        filled = 0
        while filled < count:
            if self._index >= _N:
                self._twist()
            take = min(count - filled, _N - self._index)
            y = self._state[self._index:self._index + take].copy()
            y ^= y >> np.uint32(11)
            y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
            y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
            y ^= y >> np.uint32(18)
            out[filled:filled + take] = y
            filled += take
            self._index += take
        return out


def randperm(n: int, generator: MT19937) -> np.ndarray:
    """``torch.randperm(n, generator=g)`` for a CPU generator ``g`` in the same state (int64)."""
    if not 0 <= n < 2**32 // 20:
        raise ValueError(f"randperm takes 0 <= n < {2**32 // 20}, got {n}")
    out = np.arange(n, dtype=np.int64)
    draws = generator.draws(max(n - 1, 0)).astype(np.int64)
    for i in range(n - 1):
        j = i + int(draws[i]) % (n - i)
        out[i], out[j] = out[j], out[i]
    return out


def local_batches(n: int, batch_size: int, local_epochs: int, local_steps: int,
                  seed: int) -> Iterator[np.ndarray]:
    """The example indices of each local step, in the order ``fedgc.training.train_locally``
    takes them: ``local_steps`` steps if positive, else ``local_epochs`` epochs of
    ``ceil(n / batch_size)`` steps; a new permutation whenever one is used up."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"local_batches needs n >= 1 and batch_size >= 1, got {n}, {batch_size}")
    total = local_steps if local_steps > 0 else local_epochs * math.ceil(n / batch_size)
    generator = MT19937(seed)
    order = randperm(n, generator)
    cursor = 0
    for _ in range(total):
        if cursor >= n:
            order, cursor = randperm(n, generator), 0
        yield order[cursor:cursor + batch_size]
        cursor += batch_size
