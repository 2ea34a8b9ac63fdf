"""``tcs``: time-correlated sparsification (Ozfatura, Ozfatura, Gunduz, ISIT 2021).

Each round the server picks a mask per sparsified tensor: the ``density`` fraction of its entries
where the last aggregate moved most (a moving average of aggregates with ``tcs.mask_momentum`` >
0), and sends it with the model as round material (the shared-index channel of ``dgc``,
:class:`fedgc.methods.dgc.SharedSigns`, Golomb-Rice coded; the downlink pays for it). Every
sampled client adds its pseudo-gradient to its residual and sends the residual's *values* at the
mask, without indices (the server holds the mask), plus its own top-k outside the mask, with
indices, ``tcs.topk_share`` times the mask's size: what the mask misses, discovered. What it sent
leaves the residual (error feedback). The server averages each masked coordinate over every
client of the round, as dense FedAvg does, and the next mask follows from that aggregate: a
coordinate stays in the mask while it keeps moving, and one that the clients' top-k push up
enters it. Before the first aggregate there is no mask and a client sends its top-k alone, as
many entries as mask and top-k together.

The payload (kind ``masked``, magic ``FGCV``, ``docs/wire.md`` section 17) is framed as every
fedgc payload (:mod:`dgc.wire.framing`)::

    "FGCV" | version u8 = 1 | count u32
    | (name_len u16 | name | k u64 | value dtype u8 | k values) * count
    | an FGCU message (dgc.encode): the entries outside the mask, and the tensors sent whole
    | crc32 u32

The ``k`` values of a masked tensor belong at its mask's indices in increasing order; its decoder
needs the round's mask (:attr:`Bound.material`) and holds every client to it: one value per mask
index, every masked tensor present, no entry of the top-k inside the mask, at most the top-k's
size outside it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

import dgc
from dgc import (
    Compressor,
    DecodeError,
    DGCConfig,
    EncodeError,
    SparseTensor,
    SparseUpdate,
    StateError,
)
from dgc.selection import select_stable
from dgc.signs.codec import decode_mask
from dgc.signs.planner import SharedIndexPlanner
from dgc.sparse import VALUE_DTYPES
from dgc.wire.framing import (
    Preamble,
    name_bytes,
    open_records,
    read,
    read_name,
    seal,
)
from dgc.wire.value_codings import DTYPES_BY_ID, RAW_BITS, VALUE_DTYPE_IDS, raw_values
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.compressors import ResidualCompressor
from fedgc.methods.dgc import SharedSigns
from fedgc.methods.material import Channel, RoundMaterial
from fedgc.methods.payloads import Bound, Codec, Payload, PayloadError, check_tensors
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.sparsifier import SparsifierSettings, layer_config
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS
from fedgc.schema import Check, setting

__all__ = ["TCS", "Budget", "MaskedCodec", "MaskedPayload", "MaskedUpdate", "TCSCompressor",
           "TCSSettings", "cast_values", "largest"]

#: The paper's sparsification: the mask is a hundredth of the entries ("100 times").
TCS_DENSITY = 0.01

PREAMBLE = Preamble(b"FGCV", 1, "I")  # masked tensor count
_TAIL = struct.Struct("<QB")  # k, value dtype id
#: The least bytes of a masked tensor's record: an empty name, k and dtype.
_MIN_RECORD = 2 + _TAIL.size


@dataclass(frozen=True)
class TCSSettings(SparsifierSettings):
    """TCS's own keys (``tcs.*``), on the sparsifiers' shared ones (its layer policy, value
    precision and small tensors' density); the mask's density is the shared ``density`` (TCS:
    0.01)."""

    topk_share: float = setting(
        0.1, "tcs.topk_share", "entries a client sends outside the server's mask (its top-k of "
        "the residual there, with indices), as a fraction of the mask's entries in that tensor; "
        "0: the mask only, which then never changes", Check(0.0, 1.0))
    mask_momentum: float = setting(
        0.0, "tcs.mask_momentum", "factor of the moving average of aggregates by which the "
        "server ranks the mask; 0: the last aggregate alone (the paper's)",
        Check(0.0, 1.0, high_open=True))


@dataclass(frozen=True)
class Budget:
    """How many entries of a sparsified tensor a TCS client sends: the mask's size (as the
    server's planner counts it, :meth:`SharedIndexPlanner.count`) and its top-k's."""

    density: float
    small_density: float
    small_numel: int
    share: float

    def mask(self, numel: int) -> int:
        """Entries of the mask of a tensor of ``numel`` entries."""
        small = self.small_density > 0 and numel <= self.small_numel
        return max(1, min(numel, round((self.small_density if small else self.density) * numel)))

    def topk(self, numel: int, mask: int | None) -> int:
        """Entries outside a mask of ``mask`` entries (None: no mask this round; the top-k then
        takes the mask's share too)."""
        if mask is None:
            base = self.mask(numel)
            return min(numel, base + math.ceil(self.share * base))
        return min(numel - mask, math.ceil(self.share * mask))


@dataclass
class MaskedUpdate(SparseUpdate):
    """What a TCS client sends: ``tensors`` are the entries outside the mask (and the tensors
    sent whole), ``masked`` the values at the round's mask (indices: the mask's)."""

    masked: dict[str, SparseTensor] = field(default_factory=dict)

    @property
    def nnz(self) -> int:  # type: ignore[override]
        """Entries carried, the mask's values included."""
        return super().nnz + sum(t.nnz for t in self.masked.values())


@dataclass
class MaskedPayload(Payload):
    """A decoded TCS payload: ``update`` (entries outside the mask, tensors sent whole) and
    ``masked`` (the values at the round's mask, at its indices)."""

    update: SparseUpdate
    masked: SparseUpdate

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.update.sequence

    def parts(self) -> list[SparseUpdate]:
        return [self.update, self.masked] if self.masked.tensors else [self.update]

    @property
    def nnz(self) -> int:
        return self.update.nnz + self.masked.nnz

    @property
    def density(self) -> float:
        numel = self.update.numel
        return self.nnz / numel if numel else 0.0


def cast_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` as they travel (float16 clamped to its finite range)."""
    if dtype == torch.float16:
        return values.clamp(-65504.0, 65504.0).to(dtype)
    return values.to(dtype)


def largest(score: torch.Tensor, k: int) -> torch.Tensor:
    """The increasing int64 positions of the ``k`` largest entries of the flat ``score``, ties
    at the k-th largest to the lower positions: a rule a phone reproduces in any language (a
    top-k kernel leaves the choice among ties unspecified); the set ``torch.topk`` picks
    whenever no tie straddles the k-th entry, and at its cost then
    (:func:`dgc.selection.select_stable`, which resolves only such a tie). No position for
    ``k <= 0``; ValueError for ``k`` above ``score``'s size or a NaN in it."""
    if k > score.numel():
        raise ValueError(f"the {k} largest of {score.numel()} entries asked for: k must be at "
                         f"most the entries' count")
    return select_stable(score, k)


class TCSCompressor(ResidualCompressor):
    """The residual's values at the round's mask and its top-k outside it (implements
    :class:`dgc.base.Compressor`).

    Parameters
    ----------
    policy : dgc.DGCConfig
        Which tensors are sent whole (``sends_dense``) and the values' precision
        (``value_dtype``).
    budget : Budget
        The top-k's size per tensor.
    masks : mapping of str to numpy array, or None
        The round's masks (sorted int64 flat indices per sparsified tensor); None: none.
    """

    label = "TCS"

    def __init__(self, policy: Any, budget: Budget,
                 masks: Mapping[str, np.ndarray] | None = None) -> None:
        self.policy, self.budget = policy, budget
        self.masks = dict(masks or {})
        super().__init__()
        self._dtype = VALUE_DTYPES[policy.value_dtype]

    def _check(self, grads: Mapping[str, torch.Tensor]) -> None:
        self.check_gradients(grads)
        for name, mask in self.masks.items():
            g = grads.get(name)
            if g is None or self.policy.sends_dense(tuple(g.shape)):
                raise StateError(f"the round's mask names {name!r}, which this client "
                                 f"{'sends whole' if g is not None else 'does not hold'}")
            if len(mask) and (int(mask[0]) < 0 or int(mask[-1]) >= g.numel()):
                raise StateError(f"the mask of {name!r} falls outside [0, {g.numel()})")

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> MaskedUpdate:
        """Add ``grads`` to the residual; send it at the mask and at its top-k outside it."""
        self._check(grads)
        sequence = 0 if sequence is None else int(sequence)
        rest: dict[str, SparseTensor] = {}
        masked: dict[str, SparseTensor] = {}
        for name, g in grads.items():
            shape = tuple(g.shape)
            # On the host, where the residual, the mask and the wire's bytes live (sim.device =
            # cuda too).
            v = self.memory.accumulate(name, g.detach().reshape(-1).to("cpu", torch.float32))
            if self.policy.sends_dense(shape):
                idx = torch.arange(v.numel(), dtype=torch.int64)
                values = cast_values(v.clone(), self._dtype)  # a copy: v is cleared next
                self.memory.mark_sent(name, idx, values, False)
                rest[name] = SparseTensor(idx, values, shape)
                continue
            score = v.abs()
            mask = self.masks.get(name)
            if mask is not None:
                m = torch.from_numpy(np.asarray(mask, dtype=np.int64))
                values = cast_values(v[m], self._dtype)
                self.memory.mark_sent(name, m, values, False)
                masked[name] = SparseTensor(m, values, shape)
                score[m] = -1.0  # below every magnitude: the top-k looks outside the mask
            k = self.budget.topk(v.numel(), None if mask is None else len(mask))
            idx = largest(score, k)
            values = cast_values(v[idx], self._dtype)
            self.memory.mark_sent(name, idx, values, False)
            rest[name] = SparseTensor(idx, values, shape)
        return MaskedUpdate(rest, sequence, masked=masked)


class MaskedCodec(Codec):
    """The ``FGCV`` payload (module docstring). With ``policy`` and ``budget`` (the run's) its
    :meth:`check` holds a client to the top-k's size."""

    kind = "masked"

    def __init__(self, policy: Any = None, budget: Budget | None = None) -> None:
        self.policy, self.budget = policy, budget

    def encode(self, payload: object) -> bytes:
        if isinstance(payload, MaskedPayload):
            rest, masked = payload.update, payload.masked.tensors
        elif isinstance(payload, MaskedUpdate):
            rest, masked = SparseUpdate(payload.tensors, payload.sequence), payload.masked
        else:
            raise TypeError(f"the FGCV payload encodes a MaskedUpdate, got "
                            f"{type(payload).__name__}")
        parts = [PREAMBLE.pack(len(masked))]
        for name, t in masked.items():
            if t.nnz > 1 and not bool((t.indices[1:] > t.indices[:-1]).all()):
                raise EncodeError(f"masked tensor {name!r}: its indices (the mask's) must "
                                  f"increase")
            if not bool(torch.isfinite(t.values).all()):
                raise EncodeError(f"masked tensor {name!r} carries NaN or Inf values")
            parts += [name_bytes(name), _TAIL.pack(t.nnz, VALUE_DTYPE_IDS[t.values.dtype]),
                      raw_values(t.values).tobytes()]
        parts.append(dgc.encode(rest))
        return seal(parts)

    def decode(self, data: bytes, bound: Bound) -> MaskedPayload:
        view, (count,), end = open_records(data, PREAMBLE, _MIN_RECORD, "masked tensors")
        masks: Mapping[str, np.ndarray] = bound.material or {}
        pos, masked = PREAMBLE.size, {}
        for _ in range(count):
            name, pos = read_name(view, pos, end, "masked tensor name")
            if name in masked:
                raise DecodeError(f"values for {name!r} appear twice")
            mask = masks.get(name)
            if mask is None:
                raise DecodeError(f"values for {name!r}, which has no mask this round")
            shape = bound.shapes.get(name)
            if shape is None:
                raise DecodeError(f"values for {name!r}, which the model does not have")
            k, dtype_id = read(_TAIL, view, pos, end, f"header of {name!r}")
            pos += _TAIL.size
            if k != len(mask):
                raise DecodeError(f"{k} values for {name!r}, its mask holds {len(mask)}")
            dtype = DTYPES_BY_ID.get(dtype_id)
            if dtype is None:
                raise DecodeError(f"masked tensor {name!r}: unknown value dtype {dtype_id}")
            wire, view_dtype, exponent = RAW_BITS[dtype]
            nbytes = k * view_dtype.itemsize
            if pos + nbytes > end:
                raise DecodeError(f"truncated input: the values of {name!r} need {nbytes} "
                                  f"bytes at offset {pos}")
            raw = np.frombuffer(view, dtype=wire, count=k, offset=pos)
            if ((raw & exponent) == exponent).any():
                raise DecodeError(f"masked tensor {name!r} carries NaN or Inf values")
            pos += nbytes
            values = torch.from_numpy(raw.astype(wire.replace("u", "i"))).view(dtype)
            masked[name] = SparseTensor(torch.from_numpy(np.asarray(mask, dtype=np.int64)),
                                        values, tuple(shape))
        if missing := sorted(set(masks) - set(masked)):
            raise DecodeError(f"no values for {missing}, masked this round")
        rest = dgc.decode(view[pos:end], max_numel=bound.max_numel)
        return MaskedPayload(rest, SparseUpdate(masked, rest.sequence))

    def check(self, payload: MaskedPayload, bound: Bound) -> None:  # type: ignore[override]
        rest = payload.update
        if rest.packed is not None:
            layout = rest.packed.layout
            check_tensors(dict(zip(layout.names, layout.shapes, strict=True)), bound.shapes)
        else:
            check_tensors({n: t.shape for n, t in rest.tensors.items()}, bound.shapes)
        if self.policy is None or self.budget is None:
            return
        masks: Mapping[str, np.ndarray] = bound.material or {}
        for name, t in rest.tensors.items():
            if self.policy.sends_dense(t.shape):
                continue
            mask = masks.get(name)
            want = self.budget.topk(t.numel, None if mask is None else len(mask))
            if t.nnz > want:
                raise PayloadError(f"tensor {name!r} carries {t.nnz} entries outside the mask, "
                                   f"tcs sends at most {want} of it this round")
            if mask is not None and t.nnz and bool(
                    torch.isin(t.indices, torch.from_numpy(np.asarray(mask))).any()):
                raise PayloadError(f"tensor {name!r} sends entries of the mask with indices; "
                                   f"they travel as the mask's values")

    def golden_bound(self, case: str) -> Bound:
        return Bound(_GOLDEN_SHAPES, material=None if case == "no_mask" else _GOLDEN_MASKS,
                     limit=2**62)

    def golden_cases(self) -> list[tuple[str, Any]]:
        def tensor(indices: list[int], values: list[float], shape: tuple[int, ...],
                   dtype: torch.dtype) -> SparseTensor:
            return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                                torch.tensor(values, dtype=torch.float32).to(dtype), shape)

        w, m = _GOLDEN_MASKS["fc.weight"].tolist(), _GOLDEN_MASKS["层.权重"].tolist()
        return [
            ("no_mask", MaskedUpdate({"fc.weight": tensor([3, 200], [0.5, -2.0], (16, 16),
                                                          torch.float16)}, 1)),
            ("mask_and_topk", MaskedUpdate({
                "fc.weight": tensor([7, 255], [-0.75, 4.0], (16, 16), torch.float16),
                "fc.bias": tensor([0, 1, 2], [1.0, -1.0, 0.25], (3,), torch.float32),
                "层.权重": tensor([], [], (4, 5), torch.bfloat16)}, 9, masked={
                "fc.weight": tensor(w, [0.5, -1.25, 3.0, 0.0], (16, 16), torch.float16),
                "层.权重": tensor(m, [-2.0, 0.125], (4, 5), torch.bfloat16)})),
        ]


#: The model and masks the golden cases are decoded against (``tests/golden/payloads``).
_GOLDEN_SHAPES = {"fc.weight": (16, 16), "fc.bias": (3,), "层.权重": (4, 5)}
_GOLDEN_MASKS = {"fc.weight": np.array([0, 17, 100, 254], dtype=np.int64),
                 "层.权重": np.array([4, 19], dtype=np.int64)}


class TCS(PhoneExport, RoundMaterial, Method[TCSSettings]):
    """Time-correlated sparsification (module docstring)."""

    name = "tcs"
    label = "TCS"
    order = 45
    family = "shared positions"
    compared = False  # a catalogue method: compare --methods ...,tcs
    description = ("the residual's values at the server's mask (`density` of each tensor where "
                   "the last aggregate moved most; no indices) and its top-k outside it "
                   "(`tcs.topk_share` of the mask), fp16")
    keeps_residual = True
    settings = TCSSettings
    defaults = {"density": TCS_DENSITY, **FOLD_BACK_DEFAULTS}
    secure_sum = "material"  # the mask's values and the tensors sent whole

    def policy(self, train: TrainSettings) -> DGCConfig:
        """DGC's layer policy and value precision for the run (``dgc.min_sparse_numel``,
        ``dgc.sparse_vectors``, ``dgc.value_dtype``)."""
        return layer_config(train, self.own, momentum=0.0, momentum_correction=False,
                            momentum_masking=False, error_feedback=True)

    def budget(self, train: TrainSettings) -> Budget:
        """The mask's and the top-k's sizes: ``density``, and ``dgc.small_density`` (when
        larger) for tensors of at most ``dgc.small_numel`` entries, as the other methods of
        the DGC family give their output layer."""
        own, density = self.own, float(train.density)  # type: ignore[arg-type]
        small = max(own.small_density, density) if own.small_density > 0 else 0.0
        return Budget(density, float(small), int(own.small_numel), float(own.topk_share))

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        return TCSCompressor(self.policy(train), self.budget(train), material)

    def codec(self, train: TrainSettings) -> Codec:
        return MaskedCodec(self.policy(train), self.budget(train))

    def read_material(self, data: bytes, numels: Mapping[str, int]) -> object:
        return decode_mask(data, numels)[1]

    def uplink_density(self, train: TrainSettings) -> float:
        return float(train.density) * (1.0 + float(self.own.topk_share))

    # -- phones: the mask's values and the top-k on the host (android_bridge.host_encoders);
    # the bridge forwards the round's mask as the task's shared_mask
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        """The layer policy and value dtype; its density is the uplink's, the mask's and the
        top-k's (the host encoder takes the two apart from the task's ``budget``)."""
        return replace(self.policy(train), density=self.uplink_density(train))

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        """TCS's host encoder, the ``masked`` payload and its budget (:class:`Budget`'s
        fields): the layer policy and value dtype travel in the task's DGC config."""
        return {"encoder": self.name, "payload": MaskedCodec.kind,
                "budget": asdict(self.budget(train))}

    def phone_codec(self) -> Codec:
        return MaskedCodec()

    def channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        train = run.train
        policy, budget = self.policy(train), self.budget(train)
        sparse = {n: tuple(s) for n, s in shapes.items() if not policy.sends_dense(tuple(s))}
        if not sparse:
            return None
        planner = SharedIndexPlanner(sparse, budget.density, budget.small_density,
                                     budget.small_numel, float(self.own.mask_momentum))
        return SharedSigns(planner, {n: math.prod(s) for n, s in shapes.items()})


register(TCS())
