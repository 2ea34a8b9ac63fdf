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
        out = torch.zeros(self.numel, dtype=dtype)
        out.index_put_((self.indices,), self.values.to(dtype))
        return out.view(self.shape)


@dataclass
class SparseUpdate:
    """A model update as sparse tensors keyed by parameter name.

    ``sequence`` is a number the sender chooses (a client uses its round counter) so that the
    receiver can acknowledge exactly which update it applied.
    """

    tensors: dict[str, SparseTensor] = field(default_factory=dict)
    sequence: int = 0

    @property
    def nnz(self) -> int:
        """Entries carried over all tensors."""
        return sum(t.nnz for t in self.tensors.values())

    @property
    def numel(self) -> int:
        """Entries of the dense model the update covers."""
        return sum(t.numel for t in self.tensors.values())

    @property
    def density(self) -> float:
        """Fraction of entries carried (0 for an update that covers no entries)."""
        n = self.numel
        return self.nnz / n if n else 0.0

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
            out[name] = SparseTensor(torch.arange(flat.numel(), dtype=torch.int64),
                                     flat.to(dtype), tuple(t.shape))
        return cls(out, sequence)
