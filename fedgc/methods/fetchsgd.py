"""``fetchsgd``: FetchSGD, count sketches summed by the server, which keeps momentum and error.

Rothchild, Panda, Ullah, Ivkin, Stoica, Braverman, Gonzalez, Arora, "FetchSGD:
Communication-Efficient Federated Learning with Sketching", ICML 2020, as the authors' code does
it (github.com/kiddyboots216/CommEfficient: ``fed_aggregator._server_helper_sketched``, with
``csvec.CSVec``): a client keeps nothing and sends a count sketch ``S(g)`` of its update (``rows``
x ``cols`` cells: entry ``i`` of the update adds ``sign_j(i) g_i`` to cell ``(j, h_j(i))`` of every
row ``j``). A sketch is linear, so the server's weighted mean of the sketches is the sketch of the
mean update, and the server keeps its momentum and its error accumulation in sketch space::

    S_u = rho S_u + mean(S(g_i))        (server_momentum)
    S_e = S_e + S_u
    D   = top-k of U(S_e)                (U: each entry's median over the rows of
                                          sign_j(i) S_e[j, h_j(i)])
    S_e, S_u = 0 at the cells D's entries hash to
    w   = w - server_lr * D

which is the reference code's order (its learning rate scales ``D``; it zeroes the error's cells
rather than subtracting ``S(D)``: "this should work but doesn't (model diverges)"). ``D``'s values
are the sketch's estimates: no second round asks the clients for exact ones (docs/methods.md says
why). The aggregator's two sketches are in the checkpoint.

The hashes are fixed by the run's ``seed`` and each tensor's name (both ends compute them), so
neither the model's tensor order nor a round's material enter. For the tensor named ``N`` (UTF-8
bytes, FNV-1a 64-bit hash ``f(N)``), row ``j`` and entry ``i``::

    base_j = splitmix64(splitmix64(seed xor f(N)) + j);  x = splitmix64(base_j + i)
    h_j(i) = x mod cols;  sign_j(i) = -1 if x >> 63 else +1            (arithmetic mod 2^64)

The payload (kind ``sketch``, ``docs/wire.md`` section 16)::

    "FGCH" | version u8 = 1 | sequence u64 | seed u64 | rows u32 | cols u32 | value dtype u8
    | rows * cols values, row-major | crc32 u32
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dgc import DecodeError, SparseTensor, SparseUpdate
from dgc.sparse import VALUE_DTYPES
from dgc.wire.framing import Preamble, as_view, check_crc, check_end, crc_offset, seal
from dgc.wire.value_codings import VALUE_DTYPE_IDS
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import Aggregator, Method
from fedgc.methods.compressors import StatelessCompressor
from fedgc.methods.optimizer import ServerOptimizer
from fedgc.methods.payloads import Bound, Codec, Payload, PayloadError
from fedgc.methods.powersgd import raw_bytes, read_values, wire_values
from fedgc.methods.registry import register
from fedgc.schema import Check, setting

__all__ = ["CountSketch", "CountSketcher", "FetchSGD", "FetchSGDSettings", "SketchAggregator",
           "SketchCodec", "SketchPayload", "fnv1a64", "sketch_size"]

PREAMBLE = Preamble(b"FGCH", 1, "QQIIB")  # sequence, seed, rows, cols, value dtype
#: The name of the aggregation space's one tensor: the sketch table.
SPACE = "sketch"
_MASK = (1 << 64) - 1
_MAX_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class FetchSGDSettings:
    """FetchSGD's own keys (``fetchsgd.*``); docs/methods.md sets them beside the paper's."""

    rows: int = setting(5, "fetchsgd.rows", "rows of the count sketch (the reference code's "
                        "num_rows)", Check(1, 64))
    columns: float = setting(0.076, "fetchsgd.columns", "columns of the count sketch, as a "
                             "fraction of the model's entries (the code's 500,000 for "
                             "ResNet-9's 6.57 M)", Check(0.0, 1.0, low_open=True))
    k: float = setting(0.0076, "fetchsgd.k", "entries the server applies each round (the "
                       "top-k of its unsketched error), as a fraction of the model's entries "
                       "(the code's 50,000 of 6.57 M)", Check(0.0, 1.0, low_open=True))
    value_dtype: str = setting("float16", "fetchsgd.value_dtype", "precision of the sketch's "
                               "cells on the wire", Check(choices=tuple(VALUE_DTYPES)))


def sketch_size(own: FetchSGDSettings, shapes: Mapping[str, tuple[int, ...]]
                ) -> tuple[int, int, int]:
    """``(rows, cols, k)`` of a run's sketch for a model of these ``shapes``."""
    d = sum(math.prod(s) for s in shapes.values())
    return (own.rows, max(1, min(_MAX_U32, math.ceil(own.columns * d))),
            max(1, min(d, math.ceil(own.k * d))))


# ---------------------------------------------------------------------- the hashes
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea, Flood 2014) on uint64s, wrapping."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bits."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


class CountSketch:
    """The run's count sketch: ``rows`` x ``cols`` cells, hashes from ``seed`` and each
    tensor's name (module docstring); a tensor's hashes are computed once per process."""

    _cache: dict[tuple[int, int, int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __init__(self, seed: int, rows: int, cols: int) -> None:
        if rows < 1 or cols < 1:
            raise ValueError(f"a count sketch needs rows and columns >= 1, got {rows} x {cols}")
        self.seed, self.rows, self.cols = int(seed) & _MASK, int(rows), int(cols)

    def hashes(self, name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(buckets int64, signs float32), each ``rows`` x ``numel``, of tensor ``name``."""
        key = (self.seed, self.rows, self.cols, name, int(numel))
        found = self._cache.get(key)
        if found is not None:
            return found
        first = _splitmix64(np.array([self.seed ^ fnv1a64(name.encode("utf-8"))],
                                     dtype=np.uint64))[0]
        with np.errstate(over="ignore"):
            bases = _splitmix64(first + np.arange(self.rows, dtype=np.uint64))
            x = _splitmix64(bases[:, None] + np.arange(numel, dtype=np.uint64)[None, :])
        buckets = torch.from_numpy((x % np.uint64(self.cols)).astype(np.int64))
        signs = torch.from_numpy(np.where(x >> np.uint64(63), -1.0, 1.0).astype(np.float32))
        if len(self._cache) > 256:  # models of one run: a handful of tensors
            self._cache.clear()
        self._cache[key] = (buckets, signs)
        return buckets, signs

    def sketch(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 table of ``tensors`` (summed over all of them)."""
        table = torch.zeros(self.rows, self.cols, dtype=torch.float32)
        for name, t in tensors.items():
            flat = t.detach().reshape(-1).to("cpu", torch.float32)  # the hashes are the host's
            buckets, signs = self.hashes(name, flat.numel())
            for j in range(self.rows):
                table[j].index_add_(0, buckets[j], signs[j] * flat)
        return table

    def estimate(self, table: torch.Tensor, shapes: Mapping[str, tuple[int, ...]],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(every entry's estimate, flat over ``shapes`` in order, and the cells' flat index
        per row and entry, ``rows`` x d): the median over the rows of ``sign * cell`` (the
        lower median for an even count of rows, as ``CSVec`` takes it)."""
        cells, ests = [], []
        offsets = torch.arange(self.rows, dtype=torch.int64)[:, None] * self.cols
        flat_table = table.reshape(-1)
        for name, shape in shapes.items():
            buckets, signs = self.hashes(name, math.prod(shape))
            idx = buckets + offsets
            cells.append(idx)
            ests.append(flat_table[idx] * signs)
        if not cells:
            return torch.zeros(0), torch.zeros(self.rows, 0, dtype=torch.int64)
        est = torch.cat(ests, dim=1)
        return est.median(dim=0).values if self.rows > 1 else est[0], torch.cat(cells, dim=1)


# ---------------------------------------------------------------------- the payload
@dataclass
class SketchPayload(Payload):
    """A client's count sketch: ``table`` (rows x cols, its wire dtype), the ``seed`` of its
    hashes, and the model's entries it sketches (``numel``, 0 when not known)."""

    table: torch.Tensor
    seed: int
    seq: int = 0
    numel: int = 0
    _parts: list[SparseUpdate] | None = field(default=None, repr=False, compare=False)

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.seq

    def parts(self) -> list[SparseUpdate]:
        if self._parts is None:
            cells = self.table.numel()
            self._parts = [SparseUpdate({SPACE: SparseTensor(
                torch.arange(cells, dtype=torch.int64),
                self.table.reshape(-1).to(torch.float32), tuple(self.table.shape))}, self.seq)]
        return self._parts

    @property
    def nnz(self) -> int:
        """Cells carried (``clients.csv``'s ``nnz``)."""
        return int(self.table.numel())

    @property
    def density(self) -> float:
        """Cells carried, as a fraction of the model's entries (NaN when not known)."""
        return self.nnz / self.numel if self.numel else float("nan")


class SketchCodec(Codec):
    """The ``FGCH`` payload (module docstring). With the run's keys (``own``, ``seed``) a
    sketch of any other size is refused before its cells are read, and :meth:`check` refuses
    one hashed with another seed."""

    kind = "sketch"

    def __init__(self, own: FetchSGDSettings | None = None, seed: int = 0) -> None:
        self.own, self.seed = own, int(seed) & _MASK

    def encode(self, payload: object) -> bytes:
        if not isinstance(payload, SketchPayload):
            raise TypeError(f"the FGCH payload encodes a SketchPayload, got "
                            f"{type(payload).__name__}")
        rows, cols = payload.table.shape
        return seal([PREAMBLE.pack(payload.seq, payload.seed, rows, cols,
                                   VALUE_DTYPE_IDS[payload.table.dtype]),
                     raw_bytes(payload.table)])

    def decode(self, data: bytes, bound: Bound) -> SketchPayload:
        view = as_view(data)
        sequence, seed, rows, cols, dtype_id = PREAMBLE.open(view)
        end = crc_offset(view)
        numel = sum(math.prod(s) for s in bound.shapes.values())
        if self.own is not None and bound.shapes and bound.limit is None:
            want = sketch_size(self.own, bound.shapes)[:2]
            if (rows, cols) != want:
                raise DecodeError(f"a sketch of {rows} x {cols} cells, above the bound: this "
                                  f"run's sketch is {want[0]} x {want[1]}")
        elif rows * cols > bound.max_numel:
            raise DecodeError(f"a sketch of {rows} x {cols} cells, above the bound "
                              f"{bound.max_numel}")
        if rows < 1 or cols < 1:
            raise DecodeError(f"a sketch of {rows} x {cols} cells: rows and columns must be "
                              f">= 1")
        check_crc(view, end)
        values, pos = read_values(view, PREAMBLE.size, end, rows * cols, dtype_id, "the sketch")
        check_end(view, pos, end)
        return SketchPayload(values.reshape(rows, cols), seed, sequence, numel)

    def check(self, payload: Payload, bound: Bound) -> None:
        if not isinstance(payload, SketchPayload):
            raise PayloadError(f"a {type(payload).__name__} is not a sketch")
        if self.own is not None and payload.seed != self.seed:
            raise PayloadError(f"the sketch is hashed with seed {payload.seed}, this run's "
                               f"hashes use {self.seed}")
        if self.own is not None and bound.shapes and \
                tuple(payload.table.shape) != sketch_size(self.own, bound.shapes)[:2]:
            raise PayloadError(f"a sketch of {tuple(payload.table.shape)} cells; this run's is "
                               f"{sketch_size(self.own, bound.shapes)[:2]}")

    def golden_cases(self) -> list[tuple[str, Any]]:
        def table(values: list[float], rows: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).reshape(rows, -1).to(dtype)

        return [
            ("one_cell", SketchPayload(table([0.0], 1, torch.float32), 0, 0)),
            ("three_rows_float16", SketchPayload(
                table([0.5, -1.25, 3.0, 0.0, 7.75, -2.0, 1.0, 0.125, -0.5, 65504.0, 0.0, -4.0],
                      3, torch.float16), 0x0123456789ABCDEF, 7)),
            ("largest_seed_bfloat16", SketchPayload(
                table([1.0, -1.0, 0.25, 8.0], 2, torch.bfloat16), _MASK, _MASK)),
        ]


# ---------------------------------------------------------------------- client and server
class CountSketcher(StatelessCompressor):
    """A client's compressor: the sketch of its update, nothing kept (implements
    :class:`dgc.base.Compressor`; FetchSGD's clients are stateless)."""

    def __init__(self, own: FetchSGDSettings, seed: int) -> None:
        self.own, self.seed = own, int(seed) & _MASK

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SketchPayload:
        """The count sketch of ``grads`` in the wire's precision."""
        for name, g in grads.items():
            if not torch.isfinite(g).all():
                raise ValueError(f"gradient {name!r} contains NaN or Inf")
        shapes = {n: tuple(g.shape) for n, g in grads.items()}
        rows, cols, _ = sketch_size(self.own, shapes)
        table = CountSketch(self.seed, rows, cols).sketch(grads)
        return SketchPayload(wire_values(table, VALUE_DTYPES[self.own.value_dtype]), self.seed,
                             0 if sequence is None else int(sequence),
                             sum(math.prod(s) for s in shapes.values()))


class SketchAggregator(Aggregator):
    """FetchSGD's server: momentum and error accumulation in sketch space, the top-k of the
    unsketched error applied (module docstring); the two sketches are its state.

    Parameters
    ----------
    own : FetchSGDSettings
        Rows, columns, k.
    seed : int
        The run's seed (the hashes).
    momentum : float
        ``rho`` (the run's ``server_momentum``).
    """

    def __init__(self, own: FetchSGDSettings, seed: int, momentum: float) -> None:
        self.own, self.seed, self.momentum = own, int(seed), float(momentum)
        self.u: torch.Tensor | None = None  # momentum sketch
        self.e: torch.Tensor | None = None  # error sketch

    def space(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        rows, cols, _ = sketch_size(self.own, shapes)
        return {SPACE: (rows, cols)}

    def finish(self, combined: Mapping[str, torch.Tensor],
               shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, torch.Tensor]:
        rows, cols, k = sketch_size(self.own, shapes)
        s = combined[SPACE].to(torch.float32).reshape(rows, cols)
        if self.u is None or self.e is None or tuple(self.u.shape) != (rows, cols):
            self.u = torch.zeros(rows, cols)
            self.e = torch.zeros(rows, cols)
        self.u.mul_(self.momentum).add_(s)
        self.e.add_(self.u)
        est, cells = CountSketch(self.seed, rows, cols).estimate(self.e, shapes)
        top = torch.topk(est.abs(), k, sorted=False).indices
        update = torch.zeros_like(est)
        update[top] = est[top]
        hit = cells[:, top].reshape(-1)
        self.e.view(-1)[hit] = 0.0
        self.u.view(-1)[hit] = 0.0
        out, start = {}, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            out[name] = update[start:start + n].reshape(shape)
            start += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": None if self.u is None else self.u.clone(),
                "error": None if self.e is None else self.e.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        u, e = state.get("momentum"), state.get("error")
        if (u is None) != (e is None) or (u is not None and u.shape != e.shape):
            raise ValueError("fetchsgd checkpoint: the momentum and error sketches differ")
        self.u = None if u is None else u.clone()
        self.e = None if e is None else e.clone()


class FetchSGD(Method[FetchSGDSettings]):
    """FetchSGD (module docstring)."""

    name = "fetchsgd"
    phone_needs = ("a count sketch of the update with hashes both sides know (the sketch "
                   "payload): no exported sketching program or phone-side sketch codec exists")
    label = "FetchSGD"
    order = 70
    compared = False  # a catalogue method: compare --methods ...,fetchsgd
    family = "sketch"
    description = ("a count sketch of the update (`fetchsgd.rows` x `fetchsgd.columns`), fp16; "
                   "the server keeps momentum and error as sketches, applies their top-k")
    settings = FetchSGDSettings
    defaults = {"server_momentum": 0.9}
    secure_sum = "all"  # every cell of the sketch: the sum of sketches is the sketch of the sum

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> CountSketcher:
        return CountSketcher(self.own, train.seed)

    def codec(self, train: TrainSettings) -> Codec:
        return SketchCodec(self.own, train.seed)

    def aggregator(self, run: RunSettings) -> Aggregator:
        return SketchAggregator(self.own, run.train.seed, run.server.server_momentum)

    def optimizer(self, run: RunSettings) -> ServerOptimizer:
        # The momentum lives in the sketch (the aggregator): the step itself is plain.
        return ServerOptimizer(run.server.server_lr, 0.0)

    def uplink_density(self, train: TrainSettings) -> float:
        return self.own.rows * self.own.columns  # cells per model entry


register(FetchSGD())
