"""``qsgd``: QSGD's stochastic quantization to s levels per bucket, Elias-coded (Alistarh, Grubic,
Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017).

Each round a client quantizes its pseudo-gradient ``global - local``, every tensor in buckets of
``d = qsgd.bucket_size`` consecutive entries (row-major), each bucket ``v`` on its own:

1. ``||v||_2``, rounded to float32 (what travels);
2. per entry ``r = |v_i| / ||v||_2 * s`` (``s = qsgd.levels``), and the level ``l = floor(r)``
   or ``floor(r) + 1``, the latter with probability ``r - floor(r)`` (a seeded draw per client and
   round): ``E[l] = r``, so the entry ``||v||_2 * sign(v_i) * l / s`` is unbiased (the paper's
   Lemma 3.1, variance at most ``min(d / s**2, sqrt(d) / s) * ||v||_2**2``);
3. the nonzero levels are coded as the paper's "QSGD coding" does, with Elias codes of the
   integers: the gap to each nonzero entry, its sign bit, its level (here Elias gamma,
   :mod:`dgc.elias`: no longer than the paper's recursive Elias (omega) code below 128, which
   holds the levels and nearly every gap here, and decoded without a Python loop).

The paper keeps no residual (QSGD is unbiased); ``qsgd.error_feedback = true`` adds one (what the
client did not get across is added to the next round's update), off by default. The server
takes the weighted mean of the dequantized updates, as FedAvg.

The payload (``FGCQ``, ``docs/wire.md`` section 13, kind ``levels``) is framed as every fedgc
payload (:mod:`dgc.wire.framing`)::

    "FGCQ" | version u8 = 1 | sequence u64 | bucket u32 | levels u32 | count u32
    | (name_len u16 | name | ndim u8 | dims u64 * ndim | nonzero u64
       | norm f32 * ceil(numel / bucket) | code_bytes u64 | code) * count
    | crc32 u32

where a tensor's ``code`` is a bit string (least significant bit first) of the gamma codes of
its gaps, its sign bits, the gamma codes of its levels, zero-padded to a byte.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dgc import Compressor, DecodeError, DGCConfig, SparseTensor, SparseUpdate
from dgc.elias import GammaError, gamma_bits, read_gamma
from dgc.golomb import MAX_NUMEL
from dgc.wire.framing import (
    NDIM,
    Preamble,
    check_end,
    open_records,
    read,
    read_tensor_head,
    seal,
    tensor_head,
)
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.compressors import ResidualCompressor
from fedgc.methods.efsign import SIGNS_PHONE_CONFIG
from fedgc.methods.payloads import Bound, Codec, Payload, PayloadError, check_tensors
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS
from fedgc.schema import Check, setting

__all__ = ["LevelsCodec", "LevelsPayload", "LevelsUpdate", "QSGD", "QSGDCompressor",
           "QSGDSettings", "dequantize", "qsgd_seed", "quantize"]

PREAMBLE = Preamble(b"FGCQ", 1, "QIII")  # sequence, bucket, levels, tensor count
_COUNT = struct.Struct("<Q")
#: The least bytes of a tensor record: an empty name, no dims, a count, no norm, an empty code.
_MIN_RECORD = 2 + NDIM.size + _COUNT.size + _COUNT.size
#: A nonzero entry costs at least 3 bits: a 1-bit gap, its sign, a 1-bit level.
_MIN_ENTRY_BITS = 3
_MAX_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class QSGDSettings:
    """QSGD's own keys (``qsgd.*``)."""

    levels: int = setting(16, "qsgd.levels", "QSGD's s: levels per sign of a bucket's entries "
                          "(16: the paper's 4-bit variant read as s = 2**4)",
                          Check(1, _MAX_U32))
    bucket_size: int = setting(512, "qsgd.bucket_size", "QSGD's d: consecutive entries of a "
                               "tensor that share one float32 norm (the paper's 512 for its "
                               "4-bit variant)", Check(1, _MAX_U32))
    error_feedback: bool = setting(False, "qsgd.error_feedback", "keep what quantization "
                                   "changed in a residual and add it to the next update (not "
                                   "in the paper: QSGD is unbiased)")


def quantize(v: torch.Tensor, bucket: int, levels: int, rng: np.random.Generator,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 norms per bucket, int64 positions of the nonzero levels, their signed levels)
    of the flat tensor ``v`` (module docstring, steps 1-2); ``rng`` draws the rounding."""
    n = v.numel()
    buckets = -(-n // bucket)
    padded = torch.zeros(buckets * bucket, dtype=torch.float64)
    padded[:n] = v.to(torch.float64)
    norms = padded.view(buckets, bucket).square().sum(1).sqrt().to(torch.float32)
    scale = norms.to(torch.float64).repeat_interleave(bucket)[:n]
    ratio = torch.where(scale > 0, padded[:n].abs() / torch.where(scale > 0, scale, 1.0) * levels,
                        0.0)
    floor = ratio.floor()
    draw = torch.from_numpy(rng.random(n))
    level = (floor + (draw < ratio - floor).to(torch.float64)).clamp(max=levels).to(torch.int64)
    idx = torch.nonzero(level).reshape(-1)
    signed = torch.where(v[idx] < 0, -level[idx], level[idx])
    return norms, idx, signed


def dequantize(norms: torch.Tensor, idx: torch.Tensor, signed: torch.Tensor, bucket: int,
               levels: int) -> torch.Tensor:
    """The float32 values ``norm * level / s`` at ``idx`` (both ends compute them alike)."""
    return norms[idx // bucket] * signed.to(torch.float32) / float(levels)


@dataclass
class LevelsUpdate(SparseUpdate):
    """A quantized update: its dequantized values as sparse tensors (what the server sums), and
    what travels: the norms per bucket and the signed levels at each tensor's indices."""

    bucket: int = 512
    levels: int = 16
    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    signed: dict[str, torch.Tensor] = field(default_factory=dict)


class QSGDCompressor(ResidualCompressor):
    """QSGD of each tensor of a pseudo-gradient (implements :class:`dgc.base.Compressor`).

    Parameters
    ----------
    bucket, levels : int
        QSGD's d and s.
    seed : int
        This client's seed; round ``r`` draws from ``numpy.random.default_rng([seed, r])``.
    error_feedback : bool
        Keep the quantization error in a residual (not in the paper).
    """

    label = "QSGD"

    def __init__(self, bucket: int, levels: int, seed: int, error_feedback: bool) -> None:
        self.bucket, self.levels = int(bucket), int(levels)
        self.seed, self.error_feedback = int(seed), bool(error_feedback)
        super().__init__()

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> LevelsUpdate:
        """The quantized update of ``grads`` (plus the residual, with error feedback)."""
        self.check_gradients(grads)
        sequence = 0 if sequence is None else int(sequence)
        rng = np.random.default_rng([self.seed, sequence])
        out = LevelsUpdate({}, sequence, bucket=self.bucket, levels=self.levels)
        for name, g in grads.items():
            # On the host: the draws and the codes are numpy's (sim.device = cuda included).
            flat = g.detach().reshape(-1).to("cpu", torch.float32)
            v = self.memory.accumulate(name, flat) if self.error_feedback else flat
            norms, idx, signed = quantize(v, self.bucket, self.levels, rng)
            values = dequantize(norms, idx, signed, self.bucket, self.levels)
            if self.error_feedback:
                self.memory.mark_sent(name, idx, values, False)
            out.tensors[name] = SparseTensor(idx, values, tuple(g.shape))
            out.norms[name], out.signed[name] = norms, signed
        return out


@dataclass
class LevelsPayload(Payload):
    """A decoded QSGD payload: the dequantized update, and the bucket and levels it was sent
    with (what :meth:`LevelsCodec.check` holds to the run's)."""

    update: SparseUpdate
    bucket: int
    levels: int

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.update.sequence

    def parts(self) -> list[SparseUpdate]:
        return [self.update]


def _code(idx: torch.Tensor, signed: torch.Tensor) -> bytes:
    """A tensor's code section: gaps, signs, levels (module docstring)."""
    idx_np, signed_np = idx.numpy(), signed.numpy()
    gaps = np.diff(idx_np, prepend=-1)
    gap_prefix, gap_low = gamma_bits(gaps)
    level_prefix, level_low = gamma_bits(np.abs(signed_np))
    bits = np.concatenate([gap_prefix, gap_low, (signed_np < 0).astype(np.uint8),
                           level_prefix, level_low])
    return np.packbits(bits, bitorder="little").tobytes()


def _read_code(code: memoryview, count: int, numel: int, levels: int, name: str,
               ) -> tuple[np.ndarray, np.ndarray]:
    """(positions, signed levels) of a tensor's code section, every bit accounted for."""
    bits = np.unpackbits(np.frombuffer(code, dtype=np.uint8), bitorder="little")
    try:
        gaps, pos = read_gamma(bits, 0, count, numel)
        # Each gap is at most numel: their float sum bounds the exact one, which then fits.
        if count and float(gaps.sum(dtype=np.float64)) > numel * (1 + 2.0 ** -40):
            raise DecodeError(f"tensor {name!r}: positions run past its {numel} entries")
        positions = np.cumsum(gaps) - 1
        if count and int(positions[-1]) >= numel:
            raise DecodeError(f"tensor {name!r}: positions run past its {numel} entries")
        if pos + count > bits.size:
            raise DecodeError(f"truncated input: the signs of {name!r} run past its code")
        negative = bits[pos:pos + count].astype(bool)
        magnitudes, pos = read_gamma(bits, pos + count, count, levels)
    except GammaError as ex:
        raise DecodeError(f"tensor {name!r}: {ex}") from ex
    if -(-pos // 8) != len(code) or bits[pos:].any():
        raise DecodeError(f"tensor {name!r}: its code is {len(code)} bytes, its codes end at "
                          f"bit {pos} (padding must be zero bits to the byte)")
    return positions, np.where(negative, -magnitudes, magnitudes)


class LevelsCodec(Codec):
    """The ``FGCQ`` payload (module docstring). ``bucket`` and ``levels``: what
    :meth:`check` holds a client to (None: anything the wire allows)."""

    kind = "levels"

    def __init__(self, bucket: int | None = None, levels: int | None = None) -> None:
        self.bucket, self.levels = bucket, levels

    def encode(self, payload: object) -> bytes:
        if not isinstance(payload, LevelsUpdate):
            raise TypeError(f"the FGCQ payload encodes a LevelsUpdate, got "
                            f"{type(payload).__name__}")
        parts = [PREAMBLE.pack(payload.sequence, payload.bucket, payload.levels,
                               len(payload.tensors))]
        for name, t in payload.tensors.items():
            norms = payload.norms[name].to(torch.float32).contiguous()
            if norms.numel() != -(-t.numel // payload.bucket):
                raise ValueError(f"tensor {name!r}: {norms.numel()} norms for "
                                 f"{-(-t.numel // payload.bucket)} buckets")
            code = _code(t.indices, payload.signed[name])
            parts += [tensor_head(name, t.shape), _COUNT.pack(t.nnz),
                      norms.numpy().astype("<f4").tobytes(), _COUNT.pack(len(code)), code]
        return seal(parts)

    def decode(self, data: bytes, bound: Bound) -> LevelsPayload:
        view, (sequence, bucket, levels, count), end = open_records(data, PREAMBLE, _MIN_RECORD)
        if bucket < 1 or levels < 1:
            raise DecodeError(f"bucket {bucket} and levels {levels} must be at least 1")
        limit = min(MAX_NUMEL, bound.max_numel)
        pos, tensors = PREAMBLE.size, {}
        for _ in range(count):
            name, shape, numel, pos = read_tensor_head(view, pos, end, tensors, limit)
            (nonzero,) = read(_COUNT, view, pos, end, f"count of {name!r}")
            pos += _COUNT.size
            if nonzero > numel:
                raise DecodeError(f"tensor {name!r} claims {nonzero} of {numel} entries")
            buckets = -(-numel // bucket)
            if pos + 4 * buckets > end:
                raise DecodeError(f"truncated input: the {buckets} norms of {name!r} need "
                                  f"{4 * buckets} bytes at offset {pos}")
            raw = np.frombuffer(view[pos:pos + 4 * buckets], dtype="<u4")
            pos += 4 * buckets
            if raw.size and int(raw.max()) >= 0x7F800000:  # sign bit, Inf or NaN
                raise DecodeError(f"tensor {name!r}: a norm is negative, NaN or Inf")
            (nbytes,) = read(_COUNT, view, pos, end, f"code length of {name!r}")
            pos += _COUNT.size
            if nbytes > end - pos:
                raise DecodeError(f"truncated input: the code of {name!r} needs {nbytes} "
                                  f"bytes at offset {pos}")
            if nonzero * _MIN_ENTRY_BITS > 8 * nbytes:
                raise DecodeError(f"tensor {name!r}: {nonzero} entries cannot fit in a code "
                                  f"of {nbytes} bytes")
            positions, signed = _read_code(view[pos:pos + nbytes], nonzero, numel, levels, name)
            pos += nbytes
            norms = torch.from_numpy(raw.astype(np.uint32).view(np.float32).copy())
            idx, lv = torch.from_numpy(positions), torch.from_numpy(signed)
            if nonzero and bool((norms[idx // bucket] == 0).any()):
                raise DecodeError(f"tensor {name!r}: a nonzero level in a bucket of norm 0")
            tensors[name] = SparseTensor(idx, dequantize(norms, idx, lv, bucket, levels),
                                         tuple(shape))
        check_end(view, pos, end)
        return LevelsPayload(SparseUpdate(tensors, sequence), bucket, levels)

    def check(self, payload: LevelsPayload, bound: Bound) -> None:  # type: ignore[override]
        update = payload.update
        check_tensors({n: t.shape for n, t in update.tensors.items()}, bound.shapes)
        for what, sent, want in (("bucket size", payload.bucket, self.bucket),
                                 ("levels", payload.levels, self.levels)):
            if want is not None and sent != want:
                raise PayloadError(f"the update is quantized with {what} {sent}, the run's "
                                   f"QSGD uses {want}")

    def golden_cases(self) -> list[tuple[str, Any]]:
        def case(sequence: int, bucket: int, levels: int,
                 tensors: dict[str, tuple[tuple[int, ...], list[float], dict[int, int]]],
                 ) -> LevelsUpdate:
            out = LevelsUpdate({}, sequence, bucket=bucket, levels=levels)
            for name, (shape, norms, entries) in tensors.items():
                norm_t = torch.tensor(norms, dtype=torch.float32)
                idx = torch.tensor(sorted(entries), dtype=torch.int64)
                signed = torch.tensor([entries[i] for i in sorted(entries)], dtype=torch.int64)
                out.tensors[name] = SparseTensor(idx, dequantize(norm_t, idx, signed, bucket,
                                                                 levels), shape)
                out.norms[name], out.signed[name] = norm_t, signed
            return out

        return [
            ("empty", case(0, 512, 16, {})),
            ("two_buckets", case(7, 4, 3, {
                "fc.weight": ((2, 3), [1.5, 0.25], {0: 1, 2: -3, 3: 2, 5: -1}),
                "fc.bias": ((3,), [0.0], {})})),
            ("wide_gap_and_levels", case(2**64 - 1, 512, 255, {
                "层.权重": ((40, 50), [2.0, 1.0, 0.5, 4.0], {0: 255, 1000: -17, 1999: 128})})),
        ]


class QSGD(PhoneExport, Method[QSGDSettings]):
    """QSGD of the pseudo-gradient, every tensor, no residual by default (module docstring)."""

    name = "qsgd"
    label = "QSGD"
    order = 50
    compared = False  # a catalogue method: compare --methods ...,qsgd
    family = "quantization"
    description = ("every entry stochastically rounded to `qsgd.levels` of its bucket's float32 "
                   "norm (`qsgd.bucket_size`), unbiased; gaps, signs and levels Elias-coded")
    settings = QSGDSettings
    defaults = FOLD_BACK_DEFAULTS  # with qsgd.error_feedback only

    def with_keys(self, values: Mapping[str, object]) -> Method[QSGDSettings]:
        configured = super().with_keys(values)
        # A residual only with error feedback: the client then keeps state and folds back an
        # update the server did not aggregate, as every keeps_residual method.
        configured.keeps_residual = bool(configured.own.error_feedback)  # type: ignore[misc]
        return configured

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        own = self.own
        return QSGDCompressor(own.bucket_size, own.levels, qsgd_seed(train, client_key),
                              own.error_feedback)

    def codec(self, train: TrainSettings) -> Codec:
        return LevelsCodec(self.own.bucket_size, self.own.levels)

    def uplink_density(self, train: TrainSettings) -> float:
        return 1.0  # every entry is quantized; the zero levels cost their gaps' bits

    # -- phones: the quantizer on the host (android_bridge.host_encoders), no program
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        return SIGNS_PHONE_CONFIG  # every entry of every tensor; the program is not run

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        """QSGD's host encoder, the ``levels`` payload, the client's seed (its draws) and
        ``qsgd.*``."""
        own = self.own
        return {"encoder": self.name, "payload": LevelsCodec.kind,
                "seed": qsgd_seed(train, client_key), "bucket": int(own.bucket_size),
                "levels": int(own.levels), "error_feedback": bool(own.error_feedback)}

    def phone_codec(self) -> Codec:
        return LevelsCodec()


def qsgd_seed(train: TrainSettings, client_key: int) -> int:
    """A client's seed for its rounding draws: one per client and run (round ``r`` draws from
    ``numpy.random.default_rng([seed, r])``)."""
    return (int(train.seed) << 32) + int(client_key)


register(QSGD())
