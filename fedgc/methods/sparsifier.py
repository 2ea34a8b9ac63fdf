"""The sparsifiers' shared keys and layer policy: what topk, stc, randk, tcs and dgc read alike.

Each of these methods sends some entries of each tensor and needs the same few choices: which
tensors are sent whole (``dgc.min_sparse_numel``, ``dgc.sparse_vectors``), a second density for
small tensors (``dgc.small_density``, ``dgc.small_numel``), the density warm-up, the top-k's
threshold and the values' precision. They are declared once, here, in
:class:`SparsifierSettings` under the ``dgc.`` prefix they have always had (the DGC family's
keys); a method's own settings inherit them (``class DGCSettings(SparsifierSettings)``), so each
of its runs carries them, and a run of another method does not. :func:`layer_config` turns them
into the :class:`dgc.DGCConfig` the compressors and the phone's encoder run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgc import Compressor, DGCCompressor, DGCConfig
from dgc.config import WARMUP_SCHEDULES
from dgc.sparse import VALUE_DTYPES as _VALUE_DTYPES
from dgc.two_density import TwoDensityCompressor
from fedgc.keys import TrainSettings
from fedgc.schema import Check, setting

__all__ = ["VALUE_DTYPES", "WARMUPS", "SparsifierSettings", "layer_config", "small_split",
           "split_compressor"]

#: Warm-up schedules a run key may name: DGCConfig's, but "list", whose per-round densities
#: have no run key.
WARMUPS = tuple(w for w in WARMUP_SCHEDULES if w != "list")
#: Precisions of sent values (``dgc.sparse``).
VALUE_DTYPES = tuple(_VALUE_DTYPES)


@dataclass(frozen=True)
class SparsifierSettings:
    """The keys every sparsifying method reads (module docstring); the ranges of those that
    configure :class:`dgc.DGCConfig` are that class's own (:meth:`dgc.DGCConfig.check`)."""

    small_density: float = setting(0.03, "dgc.small_density", "density of the sparsified "
                                   "tensors of at most dgc.small_numel entries (an output "
                                   "layer; topk and dgc); 0 = off, they use density",
                                   Check(0.0, 1.0))
    small_numel: int = setting(10_000, "dgc.small_numel", "size limit, in entries, of a tensor "
                               "that gets dgc.small_density", Check(1))
    warmup: str = setting("exponential", "dgc.warmup", "density warm-up schedule over the "
                          "first rounds: 4**-(r+1) until it reaches density",
                          Check(choices=WARMUPS))
    warmup_rounds: int = setting(0, "dgc.warmup_rounds", "rounds the warm-up lasts (the "
                                 "paper's warm-up epochs, counted in server rounds; 0 = none: "
                                 "with error feedback and server momentum it cost no accuracy "
                                 "in federated rounds, and its dense early rounds were a "
                                 "quarter of the uplink over 200 rounds)",
                                 DGCConfig.check("warmup_epochs"))
    selection: str = setting("sampled", "dgc.selection", "top-k threshold: exact or sampled",
                             DGCConfig.check("selection"))
    value_dtype: str = setting("float16", "dgc.value_dtype", "precision of sent values",
                               DGCConfig.check("value_dtype"))
    ternary: bool = setting(False, "dgc.ternary", "send sparsified tensors' entries as "
                            "sign * mean magnitude, one bit each on the wire (sparse ternary "
                            "compression; not for phones)")
    min_sparse_numel: int = setting(512, "dgc.min_sparse_numel", "tensors smaller than this "
                                    "(and 1-D ones unless dgc.sparse_vectors) are sent dense; "
                                    "512 (DGCConfig's 1024 sent the LSTM's embedding dense; 256 "
                                    "also sparsified the CNN's first convolution, -0.8 points)",
                                    DGCConfig.check("min_sparse_numel"))
    sparse_vectors: bool = setting(True, "dgc.sparse_vectors", "sparsify 1-D tensors (biases) "
                                   "of at least dgc.min_sparse_numel entries too, e.g. an LSTM's "
                                   "4 x hidden biases (sent dense, they were 60% of its uplink)")


def layer_config(train: TrainSettings, own: SparsifierSettings, **method: object) -> DGCConfig:
    """A :class:`DGCConfig` of the run's ``density`` and the sparsifiers' keys (selection, value
    precision, layer policy, warm-up), with ``method``'s own fields.

    The run keys of DGCConfig's fields were validated against its own ranges; the renames are
    the run's vocabulary: rounds are the paper's epochs.
    """
    return DGCConfig(
        density=train.density, selection=own.selection, value_dtype=own.value_dtype,
        ternary=own.ternary, min_sparse_numel=own.min_sparse_numel,
        sparse_vectors=own.sparse_vectors,
        warmup="exponential" if own.warmup == "exponential" and own.warmup_rounds else "none",
        warmup_epochs=max(own.warmup_rounds, 0), **method)  # type: ignore[arg-type]


def split_compressor(own: SparsifierSettings, config: DGCConfig,
                     budget: str = "tensor") -> Compressor:
    """A compressor of ``config``, with a second density for small tensors when
    ``dgc.small_density > 0``, and the total shared out by the residual with a ``budget`` other
    than ``"tensor"`` (dgc's ``dgc.budget``: :class:`dgc.DGCCompressor`).

    Small sparsified tensors (``dgc.small_numel`` entries or fewer, e.g. a 10x200 output layer)
    get ``dgc.small_density``: at ``density`` alone they would send 2 entries per update
    (docs/federated_momentum.md).
    """
    if budget != "tensor":  # one compressor shares the total out
        return DGCCompressor(config, budget=budget, small_density=own.small_density,
                             small_numel=own.small_numel)
    if own.small_density == 0.0:
        return DGCCompressor(config)
    return TwoDensityCompressor(config, own.small_density, small_numel=own.small_numel)


def small_split(own: SparsifierSettings) -> tuple[float, int] | None:
    """``(dgc.small_density, dgc.small_numel)`` when :func:`split_compressor` gives small tensors
    a density of their own; None when it does not (what a phone is told to do the same)."""
    if own.small_density == 0.0:
        return None
    return float(own.small_density), int(own.small_numel)
