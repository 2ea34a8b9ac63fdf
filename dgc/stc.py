"""STCCompressor: the client side of Sparse Ternary Compression (Sattler et al., 2019).

"Robust and Communication-Efficient Federated Learning from Non-IID Data" (IEEE TNNLS 2019,
arXiv 1903.02891), Algorithm 1 and its reference code (``compression_utils.stc`` and
``Client.compress_weight_update_up`` of github.com/felisat/federated-learning). Per update and
per tensor:

1. accumulate: ``A = A + dW`` (the residual plus this round's update; error accumulation);
2. sparsify: keep the ``k = ceil(p * numel)`` entries of largest ``|A|`` (exact top-k: the
   reference's default ``approx = 1.0``);
3. ternarise: the kept entries become ``sign(A) * mu`` with ``mu = mean(|A|)`` over them;
4. ``A = A - sent``: what was not sent, and what ternarising took from the kept entries, stays.

Unlike DGC there is no momentum correction, no momentum masking, no gradient clipping, no
warm-up and no layer policy: every tensor, biases included, is sparsified at ``p`` (the
reference applies ``stc`` to every entry of ``dW``). The positions go on fedgc's wire as
Golomb-Rice gaps and the values as one sign bit each plus ``mu`` (``dgc.encode(...,
sign_coding=True)``), the paper's Golomb position coding and binary values.

The compressor is a :class:`~dgc.DGCCompressor` configured this way, with its layer policy
turned off, so that residual, restore and state are DGC's own (``dgc.memory.DGCMemory``).
"""

from __future__ import annotations

import torch

from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig

#: STC's density in most of the paper's experiments, upstream and downstream alike
#: (p_up = p_down = 1/400).
STC_DENSITY = 1 / 400


def stc_config(density: float = STC_DENSITY, value_dtype: str = "float16") -> DGCConfig:
    """The :class:`DGCConfig` of STC at ``density``: exact top-k, ternary values, error
    accumulation, and nothing else (no momentum, masking, clipping or warm-up).

    ``value_dtype`` is the precision of ``mu`` on the wire (the signs take one bit each).
    """
    return DGCConfig(density=density, selection="exact", momentum=0.0, momentum_correction=False,
                     nesterov=False, dampening=0.0, momentum_masking=False, error_feedback=True,
                     clip_norm=None, warmup="none", min_sparse_numel=1, value_dtype=value_dtype,
                     ternary=True)


class STCCompressor(DGCCompressor):
    """Sparse Ternary Compression of one client's successive updates (module docstring).

    Implements :class:`dgc.base.Compressor`.

    Parameters
    ----------
    config : DGCConfig, optional
        :func:`stc_config` at the paper's density 1/400 when omitted. Any other config is taken
        as given, except that no tensor is sent dense.

    Example
    -------
    >>> import torch
    >>> comp = STCCompressor(stc_config(density=0.01))
    >>> update = comp.compress({"w": torch.randn(10, 100), "b": torch.randn(10)})
    >>> update.tensors["w"].nnz, update.tensors["b"].nnz
    (10, 1)
    """

    def __init__(self, config: DGCConfig | None = None) -> None:
        super().__init__(config or stc_config())

    def is_dense_tensor(self, shape: tuple[int, ...] | torch.Size) -> bool:  # noqa: ARG002
        """Never: STC sparsifies every tensor, 1-D and small ones included."""
        return False
