"""DGCState: the hyperparameters and per-parameter memory of the DGC communication hook.

Modelled on ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``: one
object holds every setting with its default and its reason, the internal state and the
statistics, and serialises from its ``__slots__``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dgc import ConfigError, DGCConfig, DGCMemory, StateError

#: Ways to move the selected entries between workers (see :class:`DGCState`, ``exchange``).
EXCHANGES = ("pairs", "golomb")
STATE_VERSION = 1


class DGCState:
    r"""Settings and memory of :func:`dgc.ddp.dgc_hook` (Lin et al., ICLR 2018, arXiv 1712.01887).

    The paper's hyperparameters live in a :class:`dgc.DGCConfig` (each documented there); the
    defaults are the paper's own, for these reasons:

    * ``density=0.001``: send the top 0.1% of each layer, the paper's 99.9% sparsity, which gave
      270x-600x compression at no accuracy loss on ResNet, AlexNet and LSTMs.
    * ``momentum=0.9`` with ``momentum_correction=True``: the residual accumulates the velocity
      ``u = m*u + g``, not the raw gradient, so that a coordinate sent late still carries the
      momentum it would have had (Sec. 3.2). The optimizer then runs **without** momentum.
    * ``momentum_masking=True``: zero ``u`` where entries were sent, or stale momentum keeps
      pushing coordinates already applied (Sec. 3.3).
    * ``clip_norm``: off by default, as in the paper for CNNs; set it for RNNs. Each worker clips
      to ``clip_norm * N ** -0.5`` before accumulating, so that the sum over N workers keeps the
      global threshold (Sec. 3.3). DDP hands the hook one bucket at a time, so the norm is the
      bucket's: with one bucket (a model under ``bucket_cap_mb``) it is the paper's global norm.
    * ``warmup="exponential"`` over ``warmup_epochs=4``: density 25%, 6.25%, 1.56%, 0.4%, then the
      target, so that the early, fast-changing gradients are not delayed too long (Sec. 3.4).
      Epochs are counted as ``iter / steps_per_epoch``, the same on every rank.
    * ``min_sparse_numel=1024``: biases, norms (``dim <= 1``) and tiny layers are sent dense; their
      indices would cost more than their values.
    * ``value_dtype="float16"``: values travel in 16 bits; the rounding error stays in the residual.

    Parameters
    ----------
    process_group : ProcessGroup or None
        The group to exchange over; ``None`` is the default (world) group.
    module : nn.Module
        The model wrapped by DDP (or DDP itself). The memory is kept per parameter, keyed by name,
        so that it survives DDP's bucket rebuild after the first iteration and loads into a run
        with another ``bucket_cap_mb``.
    config : DGCConfig, optional
        The paper's hyperparameters; the defaults above when omitted. ``ternary`` is not supported
        here. N in the clipping threshold is the process group's size; with ``clip_norm`` set, a
        ``num_workers`` other than 1 or that size is an error.
    steps_per_epoch : int or None
        Optimizer steps per epoch; needed when the config warms up (``warmup`` other than
        ``"none"`` or ``dense_epochs > 0``), since warm-up is scheduled by epoch.
    exchange : {"pairs", "golomb"}, default "pairs"
        How the selected entries travel. ``"pairs"``: one fixed-size all-gather per bucket of
        int32 bucket offsets and ``value_dtype`` values (padded to k; the size is known to every
        rank, so no size exchange and no host copy). ``"golomb"``: the fedgc wire format
        (Golomb-Rice coded gaps) per rank, preceded by an all-gather of the sizes, encoded on the
        host. Measured in ``docs/ddp.md``: pairs is the default.
    min_compression_rate : float or None
        A bucket is exchanged sparse only when its dense bytes are at least this many times its
        sparse payload; otherwise the same selection is all-reduced as a dense tensor (zeros where
        nothing was selected), which gives the same result at lower cost. ``None``: ``N / 2``,
        the break-even of a ring all-gather (each rank sends ``(N-1) * payload``) against a ring
        all-reduce (``2 (N-1) / N * dense``). 0 forces the sparse exchange.
    verify_buckets : bool, default True
        Check once per bucket layout that every rank holds the same parameters in the same order
        and sizes, and the same settings (one small all-gather), and raise :class:`StateError`
        on every rank otherwise, instead of exchanging mismatched payloads.
    """

    __slots__ = [
        "process_group",
        # Hyperparameters: the paper's (in config) and how the hook moves the entries.
        "config",
        "steps_per_epoch",
        "exchange",
        "min_compression_rate",
        # Switches.
        "verify_buckets",
        # Internal state: per-parameter momentum u and residual v, step counter, layouts seen.
        "names",
        "sizes",
        "memory",
        "iter",
        "layouts",
        # Statistics, summed over the steps of this rank.
        "dense_bytes",
        "payload_bytes",
        "sparse_buckets",
        "dense_buckets",
        "nonfinite_steps",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        module: nn.Module,
        config: DGCConfig | None = None,
        *,
        steps_per_epoch: int | None = None,
        exchange: str = "pairs",
        min_compression_rate: float | None = None,
        verify_buckets: bool = True,
    ) -> None:
        config = DGCConfig() if config is None else config
        if not isinstance(config, DGCConfig):
            raise ConfigError(f"config must be a DGCConfig, got {type(config).__name__}")
        if config.ternary:
            raise ConfigError("ternary=True is not supported by the DDP hook; use ternary=False")
        warms_up = config.warmup != "none" or config.dense_epochs > 0
        if steps_per_epoch is None:
            if warms_up:
                raise ConfigError(f"steps_per_epoch is needed to schedule warmup="
                                  f"{config.warmup!r} (dense_epochs={config.dense_epochs}); "
                                  f"pass the optimizer steps per epoch or warmup='none'")
        elif isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) \
                or steps_per_epoch < 1:
            raise ConfigError(f"steps_per_epoch must be an integer >= 1 or None, "
                              f"got {steps_per_epoch!r}")
        if exchange not in EXCHANGES:
            raise ConfigError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if min_compression_rate is not None and not (
            isinstance(min_compression_rate, (int, float))
            and not isinstance(min_compression_rate, bool)
            and math.isfinite(min_compression_rate) and min_compression_rate >= 0
        ):
            raise ConfigError(f"min_compression_rate must be a finite number >= 0 or None, "
                              f"got {min_compression_rate!r}")
        if not isinstance(verify_buckets, bool):
            raise ConfigError(f"verify_buckets must be True or False, got {verify_buckets!r}")
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be the nn.Module that DDP wraps, got "
                              f"{type(module).__name__}")
        inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) \
            else module
        named = list(inner.named_parameters())
        self.names: dict[int, str] = {id(p): n for n, p in named}
        self.sizes: dict[str, int] = {n: p.numel() for n, p in named}
        if not self.names:
            raise ConfigError("module has no parameters to compress")
        if dist.is_initialized():
            world = dist.get_world_size(process_group)
            if config.clip_norm is not None and config.num_workers not in (1, world):
                raise ConfigError(f"num_workers is {config.num_workers} but the process group "
                                  f"has {world} ranks; leave num_workers at 1 (the hook uses "
                                  f"the group's size)")
        self.process_group = process_group
        self.config = config
        self.steps_per_epoch = steps_per_epoch
        self.exchange = exchange
        self.min_compression_rate = min_compression_rate
        self.verify_buckets = verify_buckets
        self.memory = DGCMemory(config.momentum, config.momentum_correction, config.nesterov,
                                config.dampening)
        self.iter = 0
        # Bucket layouts met so far (DDP rebuilds its buckets once, after the first iteration),
        # keyed by bucket index and parameter names; filled by the hook.
        self.layouts: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.dense_bytes = 0
        self.payload_bytes = 0
        self.sparse_buckets = 0
        self.dense_buckets = 0
        self.nonfinite_steps = 0

    @property
    def epoch(self) -> float:
        """The (fractional) epoch the warm-up schedule is in, from the step counter."""
        if self.steps_per_epoch is None:
            return 0.0
        return self.iter / self.steps_per_epoch

    def density(self) -> float:
        """The density this step sends, warm-up included."""
        return self.config.density_at(self.epoch)

    def compression_ratio(self) -> float:
        """Dense float32 gradient bytes over the bytes this rank contributed, since the start."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else float("nan")

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values per parameter name (flat; the live tensors)."""
        return dict(self.memory.v)

    def __getstate__(self) -> dict[str, Any]:
        """Every slot but the process group (not serialisable), as ``PowerSGDState`` does."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        """Restore the slots; the process group becomes the default group."""
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict[str, Any]:
        """Copies of the memory on the CPU, the step counter and the config."""
        memory = self.memory.state_dict()
        return {"version": STATE_VERSION, "iter": self.iter, "config": self.config.to_dict(),
                "u": {k: t.cpu() for k, t in memory["u"].items()},
                "v": {k: t.cpu() for k, t in memory["v"].items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; validated whole, so a bad state changes nothing.

        The tensors stay on the CPU until the hook first meets their parameter, then move to
        that parameter's device.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StateError(f"DGCState state must be a mapping with version {STATE_VERSION}")
        step = state.get("iter")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"DGCState iter must be an integer >= 0, got {step!r}")
        for part in ("u", "v"):
            tensors = state.get(part, {})
            if not isinstance(tensors, Mapping):
                raise StateError(f"DGCState {part!r} must map parameter names to tensors")
            for name, t in tensors.items():
                if name not in self.sizes:
                    raise StateError(f"DGCState {part}[{name!r}] names no parameter of the "
                                     f"module")
                if not isinstance(t, torch.Tensor) or t.numel() != self.sizes[name]:
                    raise StateError(f"DGCState {part}[{name!r}] must be a tensor of "
                                     f"{self.sizes[name]} entries")
        # DGCMemory validates dtype, shape and finiteness before it replaces anything.
        self.memory.load_state_dict({"u": state.get("u", {}), "v": state.get("v", {})})
        self.iter = step

    def name_of(self, param: torch.Tensor) -> str:
        """The module's name for ``param``; a parameter the module does not hold is an error."""
        name = self.names.get(id(param))
        if name is None:
            raise StateError(f"bucket holds a parameter of shape {tuple(param.shape)} that is "
                             f"not in the module given to DGCState")
        return name
