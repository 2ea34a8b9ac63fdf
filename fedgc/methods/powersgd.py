"""``powersgd``: PowerSGD's low-rank updates with error feedback, in federated rounds.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, as torch's DDP hook does it
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``): every tensor viewed as a matrix
``M`` of ``shape[0]`` rows is approximated at rank ``r`` by one step of power iteration from a
warm-started ``Q`` (``P = M Q``, ``P`` orthonormalized, ``Q = M^T P``, ``M ~ P Q^T``); a tensor
is compressed only when ``(n + m) r * min_compression_rate < n m`` (vectors never: they travel
whole); what the approximation misses stays in an error-feedback residual.

The paper's step takes two all-reduces (of the ``P`` then of the ``Q``), so that every worker
orthonormalizes the same mean ``P``. A federated round has one exchange, so here each sampled
client does the whole step on its own residual plus pseudo-gradient, from the ``Q`` the server
sends every client of the round (its round material, :class:`PowerSGDChannel`), and replies with
its orthonormal ``P_i`` and its ``Q_i = M_i^T P_i``; its residual keeps ``M_i - P_i Q_i^T``
exactly (computed from the factors as sent, after their rounding to the wire's precision). The
server averages the clients' ``P_i Q_i^T`` in the model's space (the aggregate has rank up to
``r`` times the clients, and every fedgc defence and robust statistic applies to it unchanged)
and warm-starts the next round's ``Q`` from that aggregate by the step the hook takes from its
all-reduced ``Q``: ``Q' = orth(D^T orth(D Q))``. docs/methods.md sets this beside the paper's.

Payloads (``docs/wire.md`` section 15; framed as every fedgc payload, :mod:`dgc.wire.framing`):
the reply, kind ``low-rank`` (factors)::

    "FGCL" | version u8 = 1 | sequence u64 | count u32
    | (name_len u16 | name | ndim u8 | dims u64 * ndim | rank u16 | value dtype u8 | values)
      * count | crc32 u32

with ``rank`` 0 for a tensor sent whole (``numel`` values) and otherwise ``n * rank`` values of
``P`` then ``m * rank`` of ``Q``, row-major (``n = dims[0]``, ``m = numel / n``); the round
material, server to client::

    "FGCP" | version u8 = 1 | sequence u64 | count u32
    | (name_len u16 | name | m u64 | rank u16 | value dtype u8 | m * rank values) * count
    | crc32 u32
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dgc import DecodeError, SparseTensor, SparseUpdate, StateError
from dgc.golomb import MAX_NUMEL
from dgc.sparse import VALUE_DTYPES
from dgc.wire.framing import (
    NDIM,
    Preamble,
    check_end,
    name_bytes,
    open_records,
    read,
    read_name,
    read_tensor_head,
    seal,
    tensor_head,
)
from dgc.wire.value_codings import DTYPES_BY_ID, VALUE_DTYPE_IDS
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.material import Channel, RoundMaterial
from fedgc.methods.payloads import (
    Bound,
    Codec,
    Payload,
    PayloadError,
    check_tensors,
    largest,
)
from fedgc.methods.registry import register
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS
from fedgc.schema import Check, setting

__all__ = ["LowRankCodec", "LowRankTensor", "LowRankUpdate", "PowerSGD", "PowerSGDChannel",
           "PowerSGDCompressor", "PowerSGDSettings", "decode_material", "encode_material",
           "factored", "orthonormalize", "product", "read_values", "wire_values"]

PREAMBLE = Preamble(b"FGCL", 1, "QI")  # sequence, tensor count
MATERIAL = Preamble(b"FGCP", 1, "QI")  # sequence (the round), tensor count
_TAIL = struct.Struct("<HB")  # rank (0: whole), value dtype id
_Q_HEAD = struct.Struct("<QHB")  # m, rank, value dtype id
_MIN_RECORD = 2 + NDIM.size + _TAIL.size
_MIN_Q_RECORD = 2 + _Q_HEAD.size
_RAW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: The largest rank a message may carry (u16).
MAX_RANK = (1 << 16) - 1


@dataclass(frozen=True)
class PowerSGDSettings:
    """PowerSGD's own keys (``powersgd.*``); docs/methods.md sets them beside the paper's."""

    rank: int = setting(2, "powersgd.rank", "the rank of each compressed matrix's factors "
                        "(the hook's matrix_approximation_rank; the paper's CIFAR-10 runs "
                        "use 2)", Check(1, MAX_RANK))
    min_compression_rate: float = setting(
        2.0, "powersgd.min_compression_rate", "a matrix of n x m is compressed only when "
        "(n + m) * rank times this is below n * m; others, and vectors, travel whole",
        Check(0.0))
    warm_start: bool = setting(True, "powersgd.warm_start", "start each round's power step "
                               "from the last round's aggregate (false: a fresh random Q "
                               "every round)")
    value_dtype: str = setting("float16", "powersgd.value_dtype", "precision of the factors, "
                               "the tensors sent whole and the server's Q on the wire",
                               Check(choices=tuple(VALUE_DTYPES)))


# ---------------------------------------------------------------------- shared helpers
def wire_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as they travel in ``dtype`` (float16 saturates at its largest finite)."""
    values = values.detach().to(torch.float32)
    if dtype == torch.float16:
        values = values.clamp(-65504.0, 65504.0)
    return values.to(dtype)


def raw_bytes(values: torch.Tensor) -> bytes:
    """The values' bits, little-endian (bfloat16 too: numpy has no such type)."""
    width = values.element_size()
    return values.contiguous().view(_RAW[values.dtype]).numpy().astype(f"<i{width}").tobytes()


def read_values(view: memoryview, pos: int, end: int, count: int, dtype_id: int,
                what: str) -> tuple[torch.Tensor, int]:
    """``count`` finite values of dtype ``dtype_id`` at ``pos`` (before ``end``), and the
    offset after them; DecodeError before any allocation when the bytes are not there."""
    dtype = DTYPES_BY_ID.get(dtype_id)
    if dtype is None:
        raise DecodeError(f"{what}: unknown value dtype {dtype_id}")
    nbytes = count * torch.tensor([], dtype=dtype).element_size()
    if pos + nbytes > end:
        raise DecodeError(f"truncated input: {what} needs {nbytes} bytes at offset {pos}")
    values = (torch.frombuffer(bytearray(view[pos:pos + nbytes]), dtype=dtype) if nbytes
              else torch.empty(0, dtype=dtype))
    if not torch.isfinite(values).all():
        raise DecodeError(f"{what} carries NaN or Inf values")
    return values, pos + nbytes


def factored(shape: tuple[int, ...], rank: int, min_rate: float) -> tuple[int, int, int] | None:
    """``(n, m, r)`` of a tensor that PowerSGD compresses (the hook's ``_should_compress`` on
    the matrix ``view(shape[0], -1)``, at ``r = min(n, m, rank)``); None: sent whole."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    n = shape[0]
    m = math.prod(shape) // n
    r = min(n, m, rank)
    return (n, m, r) if r >= 1 and (n + m) * r * min_rate < n * m else None


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """The columns of ``x`` (n x r) made orthonormal in order by Gram-Schmidt, as the hook's
    ``_orthogonalize_gram_schmidt``; a column with nothing left after the projections becomes
    zero (the hook's recovery from a division by zero), never NaN."""
    out = x.detach().to(torch.float32).clone()
    for i in range(out.shape[1]):
        col = out[:, i]
        norm = torch.linalg.vector_norm(col)
        if not bool(norm > 0) or not bool(torch.isfinite(norm)):
            col.zero_()
            continue
        col.div_(norm)
        if i + 1 < out.shape[1]:
            rest = out[:, i + 1:]
            rest.sub_(col[:, None] * (col @ rest)[None, :])
    return out


def product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``P Q^T`` in float32, summed in float64: the same bits on the client (its residual) and
    the server (its aggregate) for the same factors, whatever order a BLAS sums ``r`` terms in
    (exactly, for the golden vectors' values). Its zeros are +0.0: the sign of an exact zero is
    the kernel's (torch 2.13's float64 matmul gives ``0 * -1.5`` as -0.0 on x86 and +0.0 on
    aarch64, issue 35), and ``+ 0.0`` changes nothing else."""
    return (p.to(torch.float64) @ q.to(torch.float64).T).to(torch.float32) + 0.0


# ---------------------------------------------------------------------- the payload
@dataclass
class LowRankTensor:
    """One tensor of a reply: ``p`` (n x r) and ``q`` (m x r), or ``whole`` (flat)."""

    shape: tuple[int, ...]
    p: torch.Tensor | None = None
    q: torch.Tensor | None = None
    whole: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return 0 if self.p is None else int(self.p.shape[1])

    @property
    def nnz(self) -> int:
        """Values carried."""
        if self.whole is not None:
            return int(self.whole.numel())
        return int(self.p.numel() + self.q.numel())  # type: ignore[union-attr]

    def dense(self) -> torch.Tensor:
        """The flat float32 tensor it stands for."""
        if self.whole is not None:
            return self.whole.to(torch.float32).reshape(-1)
        return product(self.p, self.q).reshape(-1)  # type: ignore[arg-type]


@dataclass
class LowRankUpdate(Payload):
    """A client's reply: its tensors as factors or whole (what the compressor returns, what
    the codec decodes). ``parts`` is their product, in the model's space (cached)."""

    tensors: dict[str, LowRankTensor]
    seq: int = 0
    _parts: list[SparseUpdate] | None = field(default=None, repr=False, compare=False)

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.seq

    def parts(self) -> list[SparseUpdate]:
        if self._parts is None:
            self._parts = [SparseUpdate({
                name: SparseTensor(torch.arange(math.prod(t.shape), dtype=torch.int64),
                                   t.dense(), t.shape)
                for name, t in self.tensors.items()}, self.seq)]
        return self._parts

    def max_abs(self) -> float:
        """A bound on every entry of ``P Q^T`` from the factors, without the product (which
        overflows float32 for factors of 1e20): ``|P_i . Q_j| <= ||P_i|| ||Q_j||``
        (Cauchy-Schwarz), in float64."""
        out = 0.0
        for t in self.tensors.values():
            if t.whole is not None:
                out = max(out, largest(t.whole))
            elif t.p is not None and t.q is not None and t.p.numel() and t.q.numel():
                rows = [float(torch.linalg.vector_norm(f.to(torch.float64), dim=1).max())
                        for f in (t.p, t.q)]
                out = max(out, rows[0] * rows[1])
        return out

    @property
    def nnz(self) -> int:
        """Values carried on the wire (``clients.csv``'s ``nnz``)."""
        return sum(t.nnz for t in self.tensors.values())

    @property
    def density(self) -> float:
        """Values carried, as a fraction of the model's entries."""
        total = sum(math.prod(t.shape) for t in self.tensors.values())
        return self.nnz / total if total else 0.0


class LowRankCodec(Codec):
    """The ``FGCL`` payload (module docstring). :meth:`check` holds a reply to the round's
    material: the tensors the server sent a ``Q`` for come back as factors of that rank and
    ``Q``'s rows, every other tensor whole."""

    kind = "low-rank"

    def encode(self, payload: object) -> bytes:
        if not isinstance(payload, LowRankUpdate):
            raise TypeError(f"the FGCL payload encodes a LowRankUpdate, got "
                            f"{type(payload).__name__}")
        parts = [PREAMBLE.pack(payload.seq, len(payload.tensors))]
        for name, t in payload.tensors.items():
            parts += [tensor_head(name, t.shape)]
            if t.whole is not None:
                parts += [_TAIL.pack(0, VALUE_DTYPE_IDS[t.whole.dtype]), raw_bytes(t.whole)]
                continue
            assert t.p is not None and t.q is not None
            n, m, r = t.shape[0], math.prod(t.shape) // t.shape[0], t.rank
            if tuple(t.p.shape) != (n, r) or tuple(t.q.shape) != (m, r) \
                    or t.p.dtype != t.q.dtype:
                raise ValueError(f"tensor {name!r}: factors {tuple(t.p.shape)} and "
                                 f"{tuple(t.q.shape)} do not factor {t.shape} at one rank "
                                 f"and dtype")
            parts += [_TAIL.pack(r, VALUE_DTYPE_IDS[t.p.dtype]), raw_bytes(t.p), raw_bytes(t.q)]
        return seal(parts)

    def decode(self, data: bytes, bound: Bound) -> LowRankUpdate:
        view, (sequence, count), end = open_records(data, PREAMBLE, _MIN_RECORD)
        limit = min(MAX_NUMEL, bound.max_numel)
        pos, tensors = PREAMBLE.size, {}
        for _ in range(count):
            name, shape, numel, pos = read_tensor_head(view, pos, end, tensors, limit)
            rank, dtype_id = read(_TAIL, view, pos, end, f"header of {name!r}")
            pos += _TAIL.size
            if rank == 0:
                whole, pos = read_values(view, pos, end, numel, dtype_id, f"tensor {name!r}")
                tensors[name] = LowRankTensor(tuple(shape), whole=whole)
                continue
            n = shape[0] if len(shape) >= 2 else 0
            m = numel // n if n else 0
            if len(shape) < 2 or rank > min(n, m):
                raise DecodeError(f"tensor {name!r} of shape {tuple(shape)} claims rank "
                                  f"{rank}: factors need 2 or more dims and a rank of at most "
                                  f"min(n, m)")
            p, pos = read_values(view, pos, end, n * rank, dtype_id, f"P of {name!r}")
            q, pos = read_values(view, pos, end, m * rank, dtype_id, f"Q of {name!r}")
            tensors[name] = LowRankTensor(tuple(shape), p.reshape(n, rank), q.reshape(m, rank))
        check_end(view, pos, end)
        return LowRankUpdate(tensors, sequence)

    def check(self, payload: Payload, bound: Bound) -> None:
        if not isinstance(payload, LowRankUpdate):
            raise PayloadError(f"a {type(payload).__name__} is not a low-rank payload")
        check_tensors({n: t.shape for n, t in payload.tensors.items()}, bound.shapes)
        if bound.material is None:
            return
        for name, t in payload.tensors.items():
            q = bound.material.get(name)
            if q is None and t.whole is None:
                raise PayloadError(f"tensor {name!r} is sent as factors; PowerSGD sends it "
                                   f"whole")
            if q is not None and (t.whole is not None or t.q is None
                                  or tuple(t.q.shape) != tuple(q.shape)):
                raise PayloadError(f"tensor {name!r} must come back at rank {q.shape[1]} with "
                                   f"a Q of {q.shape[0]} rows, the round's")

    def golden_cases(self) -> list[tuple[str, Any]]:
        def f(values: list[float], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).reshape(shape).to(dtype)

        return [
            ("empty", LowRankUpdate({}, 0)),
            ("factors_and_whole", LowRankUpdate({
                "fc.weight": LowRankTensor(
                    (4, 6), p=f([0.5, -0.5, 0.5, 0.5, 0.5, -0.5, 0.5, 0.5], (4, 2),
                                torch.float16),
                    q=f([1.0, 0.0, -2.0, 0.25, 3.0, -1.0, 0.0, 4.0, 0.125, -8.0, 2.0, 1.5],
                        (6, 2), torch.float16)),
                "fc.bias": LowRankTensor((3,), whole=f([1.0, -1.0, 0.25], (3, 1),
                                                       torch.float32).reshape(-1))}, 7)),
            ("conv_bfloat16", LowRankUpdate({
                "层.conv": LowRankTensor((3, 1, 2, 2), p=f([1.0, 0.0, 0.0], (3, 1),
                                                          torch.bfloat16),
                                         q=f([0.5, -1.5, 2.0, -4.0], (4, 1), torch.bfloat16))},
                2**64 - 1)),
        ]


# ---------------------------------------------------------------------- the round material
def encode_material(server_round: int, qs: Mapping[str, torch.Tensor]) -> bytes:
    """The ``FGCP`` message of the round's ``Q`` per compressed tensor (in their wire dtype)."""
    parts = [MATERIAL.pack(server_round, len(qs))]
    for name, q in qs.items():
        parts += [name_bytes(name), _Q_HEAD.pack(q.shape[0], q.shape[1], VALUE_DTYPE_IDS[q.dtype]),
                  raw_bytes(q)]
    return seal(parts)


def decode_material(data: bytes, numels: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """The round's ``Q`` per tensor name, float32 (m x r), read against the model's tensor
    sizes: each names a tensor of the model whose size ``m`` divides, at a rank of at most
    ``min(numel / m, m)``; DecodeError otherwise."""
    view, (_, count), end = open_records(data, MATERIAL, _MIN_Q_RECORD)
    pos, out = MATERIAL.size, {}
    for _ in range(count):
        name, pos = read_name(view, pos, end, "tensor name")
        if name in out:
            raise DecodeError(f"tensor {name!r} appears twice")
        if name not in numels:
            raise DecodeError(f"tensor {name!r} is not one of the model's")
        m, rank, dtype_id = read(_Q_HEAD, view, pos, end, f"header of {name!r}")
        pos += _Q_HEAD.size
        numel = int(numels[name])
        if m < 1 or m > numel or numel % m or rank < 1 or rank > min(m, numel // m):
            raise DecodeError(f"tensor {name!r} of {numel} entries cannot take a Q of {m} rows "
                              f"at rank {rank}")
        q, pos = read_values(view, pos, end, m * rank, dtype_id, f"Q of {name!r}")
        out[name] = q.to(torch.float32).reshape(m, rank)
    check_end(view, pos, end)
    return out


class PowerSGDChannel(Channel):
    """The server half: each round's ``Q`` for every compressed tensor, warm-started from the
    last round's aggregate (module docstring); the ``Q`` it will send next is its state.

    Parameters
    ----------
    shapes : mapping
        The model's tensors.
    own : PowerSGDSettings
        Rank, compression threshold, warm start, value dtype.
    seed : int
        The run's seed: the first round's ``Q`` (and every round's without warm start) is drawn
        from it and the round, orthonormalized.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], own: PowerSGDSettings,
                 seed: int) -> None:
        self.dims = {n: d for n, s in shapes.items()
                     if (d := factored(tuple(s), own.rank, own.min_compression_rate))}
        self.shapes = dict(shapes)
        self.warm_start, self.seed = own.warm_start, int(seed)
        self.dtype = VALUE_DTYPES[own.value_dtype]
        self.next: dict[str, torch.Tensor] | None = None  # the warm start
        self.sent: dict[str, torch.Tensor] = {}  # this round's Q, as the clients read it

    def _random(self, server_round: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1000003 + server_round) % (1 << 63))
        return {n: orthonormalize(torch.randn(m, r, generator=g))
                for n, (_, m, r) in self.dims.items()}

    def plan(self, server_round: int) -> tuple[bytes, Any] | None:
        qs = self.next if self.warm_start and self.next is not None \
            else self._random(server_round)
        wire = {n: wire_values(q, self.dtype) for n, q in qs.items()}
        self.sent = {n: q.to(torch.float32) for n, q in wire.items()}
        return encode_material(server_round, wire), self.sent

    def observe(self, aggregate: Mapping[str, torch.Tensor]) -> None:
        if not self.warm_start or not self.sent:
            return
        nxt = {}
        for name, (n, m, _) in self.dims.items():
            q = self.sent[name]
            d = aggregate[name].detach().to(torch.float32).reshape(n, m)
            new = orthonormalize(d.T @ orthonormalize(d @ q))
            # An aggregate of lower rank than r (nothing sent, a first round of biases only)
            # leaves a zero column: keep the Q the round used.
            keep = not bool(torch.isfinite(new).all()) \
                or bool((torch.linalg.vector_norm(new, dim=0) == 0).any())
            nxt[name] = q.clone() if keep else new
        self.next = nxt

    def state_dict(self) -> dict[str, Any] | None:
        return {"next": None if self.next is None
                else {n: q.clone() for n, q in self.next.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        nxt = state.get("next")
        if nxt is not None:
            for name, q in nxt.items():
                dims = self.dims.get(name)
                if dims is None or tuple(q.shape) != dims[1:]:
                    raise ValueError(f"powersgd checkpoint: Q of {name!r} does not fit the "
                                     f"model")
        self.next = None if nxt is None else {n: q.clone() for n, q in nxt.items()}


# ---------------------------------------------------------------------- the client half
class PowerSGDCompressor:
    """One client's PowerSGD step with error feedback (implements :class:`dgc.base.Compressor`).

    Parameters
    ----------
    qs : mapping of str to Tensor
        The round's ``Q`` (m x r) of every tensor to compress (the server's material); every
        other tensor is sent whole.
    dtype : torch.dtype
        The wire's precision; the residual keeps what the rounding loses too.
    """

    def __init__(self, qs: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.qs, self.dtype = dict(qs), dtype
        self.v: dict[str, torch.Tensor] = {}  # the residual, flat, per tensor

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> LowRankUpdate:
        """``M = residual + grad`` per tensor; factors of ``M`` from the round's ``Q``, or
        ``M`` whole; the residual keeps ``M`` minus what the server will add."""
        for name, g in grads.items():
            if not torch.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")
            held = self.v.get(name)
            if held is not None and held.numel() != g.numel():
                raise StateError(f"gradient {name!r} has {g.numel()} entries, the residual "
                                 f"holds {held.numel()}")
            q = self.qs.get(name)
            if q is not None and (g.dim() < 2 or g.numel() != g.shape[0] * q.shape[0]):
                raise StateError(f"the round's Q for {name!r} has {q.shape[0]} rows; the "
                                 f"tensor of shape {tuple(g.shape)} has not that many columns")
        unknown = sorted(set(self.qs) - set(grads))
        if unknown:
            raise StateError(f"the round's material names tensors the model lacks: {unknown}")
        out = {}
        for name, g in grads.items():
            shape = tuple(g.shape)
            held = self.v.get(name)
            # On the host: the factors, the residual and the wire's bytes live there.
            flat = g.detach().reshape(-1).to("cpu", torch.float32)
            mat = flat.clone() if held is None else held + flat
            q = self.qs.get(name)
            if q is None:
                whole = wire_values(mat, self.dtype)
                self.v[name] = mat - whole.to(torch.float32)
                out[name] = LowRankTensor(shape, whole=whole)
                continue
            m2 = mat.reshape(shape[0], -1)
            p = wire_values(orthonormalize(m2 @ q), self.dtype)
            qi = wire_values(m2.T @ p.to(torch.float32), self.dtype)
            self.v[name] = mat - product(p, qi).reshape(-1)
            out[name] = LowRankTensor(shape, p=p, q=qi)
        return LowRankUpdate(out, 0 if sequence is None else int(sequence))

    def restore(self, update: SparseUpdate) -> None:
        """Add an update the server did not aggregate (its product) back into the residual."""
        for name, t in update.tensors.items():
            held = self.v.get(name)
            if held is None or held.numel() != t.numel:
                raise StateError(f"update tensor {name!r} does not fit this compressor")
        for name, t in update.tensors.items():
            self.v[name].index_add_(0, t.indices, t.values.to(torch.float32))

    def residual(self) -> dict[str, torch.Tensor]:
        return self.v

    def scale_state(self, factor: float) -> None:
        for v in self.v.values():
            v.mul_(float(factor))

    def state_dict(self) -> dict[str, Any]:
        return {"v": {k: t.clone() for k, t in self.v.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        v = state.get("v") if isinstance(state, Mapping) else None
        if not isinstance(v, Mapping) or not all(
                isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point()
                for t in v.values()):
            raise StateError("PowerSGD state must map tensor names to flat float tensors "
                             "under 'v'")
        self.v = {k: t.detach().to(torch.float32).clone() for k, t in v.items()}


class PowerSGD(RoundMaterial, Method[PowerSGDSettings]):
    """PowerSGD in federated rounds (module docstring)."""

    name = "powersgd"
    phone_needs = ("the server's Q each round (round material) and a power step per matrix (the "
                   "low-rank payload): the bridge forwards index masks only (dgc's sets, tcs's "
                   "mask), not a matrix, and no exported program multiplies")
    label = "PowerSGD"
    order = 60
    compared = False  # a catalogue method: compare --methods ...,powersgd
    family = "low-rank"
    description = ("rank-`powersgd.rank` factors P, Q of each matrix from one power step on "
                   "the server's warm-started Q, fp16; vectors whole")
    keeps_residual = True
    settings = PowerSGDSettings
    defaults = FOLD_BACK_DEFAULTS

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> PowerSGDCompressor:
        if material is None:
            raise StateError("PowerSGD needs the round's Q from the server; the train message "
                             "carried none")
        return PowerSGDCompressor(material, VALUE_DTYPES[self.own.value_dtype])

    def codec(self, train: TrainSettings) -> Codec:
        return LowRankCodec()

    def read_material(self, data: bytes, numels: Mapping[str, int]) -> object:
        return decode_material(data, numels)

    def channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]]) -> Channel:
        return PowerSGDChannel(shapes, self.own, run.train.seed)

    def uplink_density(self, train: TrainSettings) -> float:
        return float("nan")  # (n + m) r of n m per matrix: no one nominal density


register(PowerSGD())

