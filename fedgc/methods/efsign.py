"""``efsign``: signSGD with error feedback (Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback
Fixes SignSGD and other Gradient Compression Schemes", ICML 2019), and the ``signs`` payload.

The paper's EF-SIGNSGD (its Algorithm 1), per worker and step: ``p = gamma * g + e`` (the
gradient step plus the error kept from before), ``delta = (||p||_1 / d) * sign(p)`` (the scaled
sign: one bit per entry and one scale), ``x -= delta``, ``e = p - delta``. In federated rounds
the step ``gamma * g`` is a client's pseudo-gradient ``global - local`` (its local steps already
carry the learning rate): each round a client adds it to its residual ``e`` and sends the scaled
sign of every tensor (``d`` its entries, a float32 scale each), keeping ``e = p - delta``; the
server takes the weighted mean of the clients' ``delta`` and steps by it (``server_lr`` 1, as the
paper's ``x -= delta``). An entry of ``p`` that is exactly 0 is sent as ``+scale``: the residual
takes the difference back.

The payload (``FGCB``, ``docs/wire.md`` section 14, kind ``signs``) also carries the votes of
``signvote`` (signSGD with majority vote, scale 1); framed as every fedgc payload
(:mod:`dgc.wire.framing`)::

    "FGCB" | version u8 = 1 | sequence u64 | count u32
    | (name_len u16 | name | ndim u8 | dims u64 * ndim | scale f32
       | ceil(numel / 8) bytes of sign bits) * count
    | crc32 u32

sign bit ``j`` (least significant first) set: entry ``j`` (row-major) is ``-scale``, clear:
``+scale``; the padding bits after the last entry are zero.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dgc import Compressor, DecodeError, DGCConfig, SparseTensor, SparseUpdate
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
from fedgc.methods.payloads import Bound, Codec, Payload, check_tensors
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS

__all__ = ["SIGNS_PHONE_CONFIG", "EFSign", "EFSignCompressor", "SignsCodec", "SignsPayload",
           "SignsUpdate", "dense_signs", "signed_values"]

PREAMBLE = Preamble(b"FGCB", 1, "QI")  # sequence, tensor count
_SCALE = struct.Struct("<I")  # the float32 scale's raw bits
#: The least bytes of a tensor record: an empty name, no dims, a scale, no signs.
_MIN_RECORD = 2 + NDIM.size + _SCALE.size


@dataclass
class SignsUpdate(SparseUpdate):
    """Every entry of every tensor as ``+scale`` or ``-scale``: the dense values (what the
    server sums) and each tensor's scale (what travels, with one bit per entry)."""

    scales: dict[str, float] = field(default_factory=dict)


def signed_values(negative: torch.Tensor, scale: float) -> torch.Tensor:
    """The float32 values ``-scale`` where ``negative``, ``+scale`` elsewhere (both ends)."""
    s = torch.tensor(scale, dtype=torch.float32)
    return torch.where(negative, -s, s)


def dense_signs(shape: tuple[int, ...], negative: torch.Tensor, scale: float) -> SparseTensor:
    """Every entry of a tensor of ``shape``, as :func:`signed_values`."""
    return SparseTensor(torch.arange(negative.numel(), dtype=torch.int64),
                        signed_values(negative, scale), shape)


class EFSignCompressor(ResidualCompressor):
    """The scaled sign of residual plus pseudo-gradient, per tensor, with error feedback
    (implements :class:`dgc.base.Compressor`)."""

    label = "EF-signSGD"

    def __init__(self) -> None:
        super().__init__()

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SignsUpdate:
        """Add ``grads`` to the residual, send its scaled sign, keep the difference."""
        self.check_gradients(grads)
        out = SignsUpdate({}, 0 if sequence is None else int(sequence))
        for name, g in grads.items():
            # On the host, where the residual and the sign bits live (sim.device = cuda too).
            p = self.memory.accumulate(name, g.detach().reshape(-1).to("cpu", torch.float32))
            # ||p||_1 / d, summed in float64 and sent as float32.
            scale = float(torch.tensor(float(p.abs().sum(dtype=torch.float64)) / max(p.numel(), 1),
                                       dtype=torch.float32))
            sent = dense_signs(tuple(g.shape), p < 0, scale)
            p.sub_(sent.values)
            out.tensors[name], out.scales[name] = sent, scale
        return out


@dataclass
class SignsPayload(Payload):
    """A decoded ``signs`` payload: the dense update and each tensor's scale."""

    update: SparseUpdate
    scales: dict[str, float]

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.update.sequence

    def parts(self) -> list[SparseUpdate]:
        return [self.update]


class SignsCodec(Codec):
    """The ``FGCB`` payload (module docstring)."""

    kind = "signs"

    def encode(self, payload: object) -> bytes:
        if not isinstance(payload, SignsUpdate):
            raise TypeError(f"the FGCB payload encodes a SignsUpdate, got "
                            f"{type(payload).__name__}")
        parts = [PREAMBLE.pack(payload.sequence, len(payload.tensors))]
        for name, t in payload.tensors.items():
            if not t.is_dense:
                raise ValueError(f"tensor {name!r}: a signs payload carries every entry")
            scale = torch.tensor([payload.scales[name]], dtype=torch.float32)
            bits = np.packbits(torch.signbit(t.values).numpy(), bitorder="little")
            parts += [tensor_head(name, t.shape),
                      scale.numpy().astype("<f4").tobytes(), bits.tobytes()]
        return seal(parts)

    def decode(self, data: bytes, bound: Bound) -> SignsPayload:
        view, (sequence, count), end = open_records(data, PREAMBLE, _MIN_RECORD)
        limit = min(MAX_NUMEL, bound.max_numel)
        pos, tensors, scales = PREAMBLE.size, {}, {}
        for _ in range(count):
            name, shape, numel, pos = read_tensor_head(view, pos, end, tensors, limit)
            (raw,) = read(_SCALE, view, pos, end, f"scale of {name!r}")
            pos += _SCALE.size
            if raw & 0x7F800000 == 0x7F800000:
                raise DecodeError(f"tensor {name!r}: its scale is NaN or Inf")
            if raw & 0x80000000:
                raise DecodeError(f"tensor {name!r}: its scale is negative")
            nbytes = -(-numel // 8)
            if pos + nbytes > end:
                raise DecodeError(f"truncated input: the signs of {name!r} need {nbytes} "
                                  f"bytes at offset {pos}")
            bits = np.unpackbits(np.frombuffer(view[pos:pos + nbytes], dtype=np.uint8),
                                 bitorder="little")
            pos += nbytes
            if bits[numel:].any():
                raise DecodeError(f"tensor {name!r}: the padding after its last sign is not "
                                  f"zero")
            scale = float(np.array([raw], dtype=np.uint32).view(np.float32)[0])
            negative = torch.from_numpy(bits[:numel].astype(bool))
            tensors[name], scales[name] = dense_signs(tuple(shape), negative, scale), scale
        check_end(view, pos, end)
        return SignsPayload(SparseUpdate(tensors, sequence), scales)

    def check(self, payload: SignsPayload, bound: Bound) -> None:  # type: ignore[override]
        check_tensors({n: t.shape for n, t in payload.update.tensors.items()}, bound.shapes)

    def golden_cases(self) -> list[tuple[str, Any]]:
        def case(sequence: int, tensors: dict[str, tuple[tuple[int, ...], float, list[int]]],
                 ) -> SignsUpdate:
            out = SignsUpdate({}, sequence)
            for name, (shape, scale, negative) in tensors.items():
                mask = torch.zeros(int(np.prod(shape)), dtype=torch.bool)
                mask[negative] = True
                out.tensors[name], out.scales[name] = dense_signs(shape, mask, scale), scale
            return out

        return [
            ("empty", case(0, {})),
            ("two_tensors", case(7, {"fc.weight": ((2, 5), 0.75, [1, 2, 8]),
                                     "fc.bias": ((3,), 1.0, [0, 2])})),
            ("zero_scale_and_largest_sequence", case(2**64 - 1, {
                "层.权重": ((4, 4), 0.0, [15]), "scalar": ((), 3.5, [0])})),
        ]


#: The phone config of a method that sends signs (efsign, signvote): every entry of every
#: tensor, plain error feedback; the encoder program it is exported with is not run.
SIGNS_PHONE_CONFIG = DGCConfig(density=1.0, selection="exact", momentum=0.0,
                               momentum_correction=False, momentum_masking=False,
                               error_feedback=True, value_dtype="float32")


class EFSign(PhoneExport, Method):
    """EF-signSGD of the pseudo-gradient, every tensor (module docstring)."""

    name = "efsign"
    label = "EF-signSGD"
    order = 51
    compared = False  # a catalogue method: compare --methods ...,efsign
    family = "signs"
    description = ("the sign of residual plus pseudo-gradient times its mean magnitude, per "
                   "tensor: one bit per entry and a float32 scale; the residual keeps the rest")
    keeps_residual = True
    defaults = FOLD_BACK_DEFAULTS

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        return EFSignCompressor()

    def codec(self, train: TrainSettings) -> Codec:
        return SignsCodec()

    def uplink_density(self, train: TrainSettings) -> float:
        return 1.0  # one bit for every entry

    # -- phones: the signs on the host (android_bridge.host_encoders), no program
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        return SIGNS_PHONE_CONFIG

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        return {"encoder": self.name, "payload": SignsCodec.kind}

    def phone_codec(self) -> Codec:
        return SignsCodec()


register(EFSign())
