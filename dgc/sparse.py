"""The in-memory form of a sparse model update: flat indices and values per named tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dgc.errors import StateError

#: Value dtypes the wire format can carry, by name.
VALUE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class SparseTensor:
    """One tensor of an update: ``values[i]`` belongs at flat position ``indices[i]``.

    ``indices`` are int64, strictly increasing and inside ``[0, numel)``; ``values`` are float32,
    float16 or bfloat16 and finite. A tensor sent dense has ``indices == arange(numel)``.
    """

    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        if self.indices.dtype != torch.int64 or self.indices.dim() != 1:
            raise StateError(f"indices must be a 1-D int64 tensor, got {self.indices.dtype} "
                             f"with {self.indices.dim()} dims")
        if self.values.dim() != 1 or self.values.numel() != self.indices.numel():
            raise StateError(f"values must be 1-D with one entry per index: "
                             f"{self.values.numel()} values for {self.indices.numel()} indices")
        if self.values.dtype not in VALUE_DTYPES.values():
            raise StateError(f"values dtype {self.values.dtype} is not one of "
                             f"{sorted(VALUE_DTYPES)}")

    @property
    def numel(self) -> int:
        """Number of entries of the dense tensor."""
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Number of entries carried."""
        return int(self.indices.numel())

    @property
    def is_dense(self) -> bool:
        """Whether every entry is carried (the wire format then sends no indices)."""
        return self.nnz == self.numel

    def to_dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense tensor, zeros where nothing was sent."""
        out = torch.zeros(self.numel, dtype=dtype, device=self.values.device)
        out.index_put_((self.indices.to(out.device),), self.values.to(dtype))
        return out.view(self.shape)


@dataclass(frozen=True)
class TensorLayout:
    """The names and shapes of an update's tensors, and their places in one flat vector.

    Tensor ``k`` occupies ``[offsets[k], offsets[k] + numel)`` of the concatenation of every
    tensor flattened, in this order. ``dense[k]`` says that it is carried in full (the wire's
    "all" coding). :func:`dgc.decode` hands out one shared layout object for messages that
    share their structure, so that a receiver checks a layout once, not once per update.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dense: tuple[bool, ...]
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        offsets, total = [], 0
        for shape in self.shapes:
            offsets.append(total)
            total += math.prod(shape)
        object.__setattr__(self, "offsets", tuple(offsets))

    @property
    def numel(self) -> int:
        """Entries of all the tensors together."""
        return self.offsets[-1] + math.prod(self.shapes[-1]) if self.shapes else 0


@dataclass
class PackedTensors:
    """Every tensor of an update in a few flat arrays: the form :func:`dgc.decode` produces.

    ``sparse_indices`` are the positions, in the layout's flat vector, of the entries of the
    tensors that are not dense, tensor after tensor (so they increase), int32 when they fit and
    int64 otherwise; ``sparse_values`` are their values. ``dense_values`` are the dense tensors'
    entries, tensor after tensor. ``counts[k]`` is the number of entries tensor ``k`` carries.
    All values share one dtype.
    """

    layout: TensorLayout
    counts: tuple[int, ...]
    sparse_indices: torch.Tensor
    sparse_values: torch.Tensor
    dense_values: torch.Tensor

    def to_tensors(self) -> dict[str, SparseTensor]:
        """The per-tensor form, sharing the packed values' memory."""
        layout = self.layout
        tensors = {}
        sparse_at = dense_at = 0
        for name, shape, dense, offset, count in zip(layout.names, layout.shapes, layout.dense,
                                                     layout.offsets, self.counts, strict=True):
            if dense:
                indices = torch.arange(count, dtype=torch.int64)
                values = self.dense_values[dense_at:dense_at + count]
                dense_at += count
            else:
                indices = self.sparse_indices[sparse_at:sparse_at + count].to(torch.int64) - offset
                values = self.sparse_values[sparse_at:sparse_at + count]
                sparse_at += count
            tensors[name] = SparseTensor(indices, values, shape)
        return tensors


@dataclass
class SparseUpdate:
    """A model update as sparse tensors keyed by parameter name.

    ``sequence`` is a number the sender chooses (a client uses its round counter) so that the
    receiver can acknowledge exactly which update it applied.

    An update from :func:`dgc.decode` starts out as ``packed`` (flat arrays, see
    :class:`PackedTensors`) and builds the ``tensors`` dict only when it is first read: a server
    that aggregates 100 updates of 161 tensors would otherwise spend more time creating 16,100
    small tensors than summing them. Once ``tensors`` exists it is the update's content and
    ``packed`` is None, so that editing the dict can never leave a stale packed copy behind.
    """

    tensors: dict[str, SparseTensor] = field(default_factory=dict)
    sequence: int = 0
    packed: PackedTensors | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_packed(cls, packed: PackedTensors, sequence: int) -> SparseUpdate:
        """An update whose ``tensors`` are built from ``packed`` on first access."""
        update = cls.__new__(cls)
        update.sequence = sequence
        update.packed = packed
        return update

    def __getattr__(self, name: str) -> dict[str, SparseTensor]:
        # Only reached when ``tensors`` is not set yet, i.e. for an update from from_packed.
        packed = self.__dict__.get("packed")
        if name != "tensors" or packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.tensors = packed.to_tensors()
        self.packed = None
        return self.tensors

    @property
    def nnz(self) -> int:
        """Entries carried over all tensors."""
        if self.packed is not None:
            return sum(self.packed.counts)
        return sum(t.nnz for t in self.tensors.values())

    @property
    def numel(self) -> int:
        """Entries of the dense model the update covers."""
        if self.packed is not None:
            return self.packed.layout.numel
        return sum(t.numel for t in self.tensors.values())

    @property
    def density(self) -> float:
        """Fraction of entries carried (0 for an update that covers no entries)."""
        n = self.numel
        return self.nnz / n if n else 0.0

    def cpu(self) -> SparseUpdate:
        """This update with every tensor on the host: ``self`` when all are there already, else
        a new update built from one device-to-host copy of everything it carries (its indices
        and values packed into one byte buffer on the device, copied, and viewed back), so that
        an update selected on an accelerator costs one transfer, not two per tensor."""
        if self.packed is not None:
            return self
        away = [p.device for t in self.tensors.values() for p in (t.indices, t.values)
                if p.device.type != "cpu"]
        return self.moved(away[0], torch.device("cpu")) if away else self

    def moved(self, source: torch.device | str, target: torch.device | str) -> SparseUpdate:
        """A copy of this update on ``target``, made by packing every index and value into one
        byte buffer on ``source`` (tensors elsewhere are brought there first), one copy of it,
        and views of the result (which they share)."""
        tensors = self.tensors
        parts = [p for t in tensors.values() for p in (t.indices, t.values)]
        # Widest elements first, so that every piece starts at a multiple of its own size in
        # the byte buffer (a view as int64 or float32 needs that alignment).
        order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
        flat = [parts[i].detach().to(source).contiguous().reshape(-1).view(torch.uint8)
                for i in order]
        host = torch.cat(flat).to(target, copy=True) if flat else \
            torch.empty(0, dtype=torch.uint8, device=target)
        moved: list[torch.Tensor] = [torch.empty(0)] * len(parts)
        at = 0
        for i, piece in zip(order, flat, strict=True):
            moved[i] = host[at:at + piece.numel()].view(parts[i].dtype)
            at += piece.numel()
        out = {name: SparseTensor(moved[2 * j], moved[2 * j + 1], t.shape)
               for j, (name, t) in enumerate(tensors.items())}
        return SparseUpdate(out, self.sequence)

    def to_dense(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Dense tensors, one per name, zeros where nothing was sent."""
        return {name: t.to_dense(dtype) for name, t in self.tensors.items()}

    @classmethod
    def from_dense(cls, tensors: Mapping[str, torch.Tensor], value_dtype: str = "float32",
                   sequence: int = 0) -> SparseUpdate:
        """Wrap dense tensors as an update that carries every entry."""
        dtype = VALUE_DTYPES[value_dtype]
        out = {}
        for name, t in tensors.items():
            flat = t.detach().reshape(-1)
            out[name] = SparseTensor(torch.arange(flat.numel(), dtype=torch.int64,
                                                  device=flat.device),
                                     flat.to(dtype), tuple(t.shape))
        return cls(out, sequence)
