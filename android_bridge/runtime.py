"""Host-side drivers that run the exported ``.pte`` files in the ExecuTorch runtime.

These are what a phone does, written in Python: :class:`PteEncoder` turns a model's named
gradients into a :class:`dgc.SparseUpdate` with the ``encoder.pte`` program and keeps the DGC state
(momentum ``u``, residual ``v``) between steps; :class:`PteTrainer` runs ``train_step.pte`` with
ExecuTorch's SGD. All arithmetic on tensors happens inside the ExecuTorch runtime; the host only
moves buffers (the Python bindings exchange ``torch.Tensor`` objects, used here as containers) and
does the scalar arithmetic of the clipping scale and of ``k``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from android_bridge.encoder import BLOCK, check_compatible, check_exportable, clip_scale
from android_bridge.export import ENCODER_FILE, MANIFEST_FILE, TRAIN_FILE, TRAIN_PREFIX
from android_bridge.notices import start_threadpool
from dgc.base import check_factor
from dgc.config import DGCConfig
from dgc.errors import ConfigError, StateError
from dgc.selection import num_selected
from dgc.sparse import VALUE_DTYPES, SparseTensor, SparseUpdate


def load_manifest(export_dir: str | Path) -> dict[str, Any]:
    """The manifest written by :func:`android_bridge.export.export_all`."""
    path = Path(export_dir) / MANIFEST_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"no {MANIFEST_FILE} in {str(export_dir)!r}; run "
                         f"`python -m android_bridge export` first") from None


def _as_flat_f32(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
    if arr.dtype.kind != "f":
        raise StateError(f"gradient {name!r} must be floating point, got dtype {arr.dtype}")
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(-1))


class PteEncoder:
    """Compresses a model's gradients step after step with the exported encoder program.

    Implements :class:`dgc.base.Compressor`, as :class:`dgc.DGCCompressor` does on the host.

    Parameters
    ----------
    pte_path : str or Path
        An ``encoder.pte`` written by the exporter.
    config : DGCConfig
        The config the program was exported with (``selection="exact"``); the host reads the
        layer policy, the warm-up schedule and the clipping threshold from it.
    shapes : mapping of str to tuple of int
        The model's parameter shapes, in the order the gradients come in.
    """

    def __init__(self, pte_path: str | Path, config: DGCConfig,
                 shapes: Mapping[str, tuple[int, ...]]) -> None:
        from executorch.runtime import Runtime

        start_threadpool()  # before the first method loads: quiet
        check_exportable(config)
        self.config = config
        self.shapes = {name: tuple(int(s) for s in shape) for name, shape in shapes.items()}
        program = Runtime.get().load_program(Path(pte_path))
        missing = {"encode", "encode_dense", "sum_squares"} - set(program.method_names)
        if missing:
            raise StateError(f"{str(pte_path)!r} lacks encoder methods {sorted(missing)}")
        self._encode = program.load_method("encode")
        # Programs exported before encode_blocked existed still run, with full topk.
        self._encode_blocked = (program.load_method("encode_blocked")
                                if "encode_blocked" in program.method_names else None)
        self._encode_dense = program.load_method("encode_dense")
        self._sum_squares = program.load_method("sum_squares")
        self._value_dtype = VALUE_DTYPES[config.value_dtype]
        # Sparse tensors keep their state zero-padded to a multiple of BLOCK for encode_blocked;
        # self.u and self.v hold length-n views of it. Dense tensors are never padded.
        self._padded_numel = {n: self._padded_length(s) for n, s in self.shapes.items()}
        self._u_full = {n: torch.zeros(p) for n, p in self._padded_numel.items()}
        self._v_full = {n: torch.zeros(p) for n, p in self._padded_numel.items()}
        self._grad_full: dict[str, torch.Tensor] = {}
        self._spares: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        for name in self.shapes:
            self._keep(name, self._u_full[name], self._v_full[name])
        # Tensors whose momentum exists (after their first step), as in DGCMemory.u.
        self.started: set[str] = set()
        self.step = 0
        # dgc.small_density: tensors of at most small_numel entries get their own density and
        # their own clipping group, as dgc.TwoDensityCompressor's second compressor (0: off).
        self.small_density = 0.0
        self.small_numel = 10_000
        self._fresh = torch.ones(1)
        self._not_fresh = torch.zeros(1)

    def _padded_length(self, shape: tuple[int, ...]) -> int:
        numel = math.prod(shape)
        if self._encode_blocked is None or self.is_dense_tensor(shape):
            return numel
        return -(-numel // BLOCK) * BLOCK

    def _spare(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded scratch buffers for the next state of ``name`` (the state before the current
        one, reused: fresh buffers cost page faults every step)."""
        spare = self._spares.get(name)
        if spare is None:
            full = self._padded_numel[name]
            spare = self._spares[name] = (torch.empty(full), torch.empty(full))
        return spare

    def _keep(self, name: str, u: torch.Tensor, v: torch.Tensor) -> None:
        """Hold ``u`` and ``v`` (length n or padded) as the state of ``name``."""
        full = self._padded_numel[name]
        numel = math.prod(self.shapes[name])
        if u.numel() != full:
            u = torch.cat([u, torch.zeros(full - u.numel())])
        if v.numel() != full:
            v = torch.cat([v, torch.zeros(full - v.numel())])
        self._u_full[name], self._v_full[name] = u, v
        self.u[name], self.v[name] = u[:numel], v[:numel]

    @classmethod
    def from_export(cls, export_dir: str | Path) -> PteEncoder:
        """The encoder of an export folder, with config and shapes from its manifest."""
        manifest = load_manifest(export_dir)
        shapes = {p["name"]: tuple(p["shape"]) for p in manifest["parameters"]}
        return cls(Path(export_dir) / ENCODER_FILE,
                   DGCConfig.from_dict(manifest["dgc_config"]), shapes)

    def reconfigure(self, config: DGCConfig, small_density: float = 0.0,
                    small_numel: int = 10_000) -> None:
        """Use ``config``'s run-time fields (density, warm-up, clipping, layer policy) from now
        on; a change of a field baked into the graph is a :class:`dgc.ConfigError`.

        ``small_density`` > 0 sends the tensors of at most ``small_numel`` entries at that
        density instead, and clips them as a group of their own, exactly as
        :class:`dgc.TwoDensityCompressor` (``dgc.small_density``, ``dgc.small_numel``) does with
        its second compressor; the state is per tensor either way.
        """
        if isinstance(small_density, bool) or not isinstance(small_density, (int, float)) \
                or not 0.0 <= small_density <= 1.0:
            raise ConfigError(f"small_density must be a number in [0, 1], got "
                              f"{small_density!r}")
        if isinstance(small_numel, bool) or not isinstance(small_numel, int) or small_numel < 1:
            raise ConfigError(f"small_numel must be an integer >= 1, got {small_numel!r}")
        check_compatible(self.config, config)
        self.config = config
        self.small_density, self.small_numel = float(small_density), small_numel

    def is_dense_tensor(self, shape: tuple[int, ...]) -> bool:
        """The layer policy of :meth:`dgc.DGCCompressor.is_dense_tensor`."""
        return self.config.sends_dense(shape)

    def compress(self, grads: Mapping[str, Any], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the state and return what to send, as ``DGCCompressor`` does.

        Every gradient is checked (known name, size, floating point, finite) before any state
        changes, so a bad gradient leaves the encoder as it was.
        """
        flat: dict[str, torch.Tensor] = {}
        for name, g in grads.items():
            if name not in self.shapes:
                raise StateError(f"gradient {name!r} is not a parameter of this model; known: "
                                 f"{sorted(self.shapes)}")
            f = _as_flat_f32(name, g)
            if f.numel() != self.v[name].numel():
                raise StateError(f"gradient {name!r} has {f.numel()} entries, the residual "
                                 f"holds {self.v[name].numel()}")
            flat[name] = f
        if self.config.check_finite:
            for name, f in flat.items():
                # A host-side pass: ExecuTorch's portable isfinite kernel is ~70x slower.
                if not np.isfinite(f.numpy()).all():
                    raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was "
                                     f"changed")
        density_of, scale_of = self._groups(flat, epoch)
        out: dict[str, SparseTensor] = {}
        new_state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, g in flat.items():
            shape = self.shapes[name]
            density, scale = density_of[name], scale_of[name]
            u, v = self._u_full[name], self._v_full[name]
            fresh = self._not_fresh if name in self.started else self._fresh
            if self.is_dense_tensor(shape):
                numel = g.numel()
                values, u_out, v_out = self._encode_dense.execute(
                    (g, u[:numel], v[:numel], scale, fresh))
                indices = torch.from_numpy(np.arange(g.numel(), dtype=np.int64))
            else:
                numel = g.numel()
                k = num_selected(numel, density)
                k_like = torch.from_numpy(np.zeros(k, dtype=np.float32))
                if (self._encode_blocked is not None and u.numel() % BLOCK == 0
                        and k <= u.numel() // BLOCK):
                    padded = self._grad_full.get(name)
                    if padded is None:
                        padded = self._grad_full[name] = torch.zeros(u.numel())
                    padded[:numel] = g
                    # Outputs not cloned: they live in the method's memory until its next call
                    # and are copied out at once.
                    idx, vals, count, u_new, v_new = self._encode_blocked._method(
                        (padded, u, v, scale, fresh, k_like), clone_outputs=False)
                    u_out, v_out = self._spare(name)
                    u_out.copy_(u_new)
                    v_out.copy_(v_new)
                else:
                    idx, vals, count, u_out, v_out = self._encode.execute(
                        (g, u[:numel], v[:numel], scale, fresh, k_like))
                c = int(count)
                indices, values = idx[:c].clone(), vals[:c].clone()
            out[name] = SparseTensor(indices, values, shape)
            new_state[name] = (u_out, v_out)
        for name, (u_out, v_out) in new_state.items():
            replaced = self._u_full[name], self._v_full[name]
            self._keep(name, u_out, v_out)
            spare = self._spares.get(name)
            if spare is not None and spare[0] is u_out:
                self._spares[name] = replaced
        if self.config.momentum_correction:
            self.started.update(new_state)
        self.step += 1
        return SparseUpdate(out, self.step if sequence is None else sequence)

    def _groups(self, flat: Mapping[str, torch.Tensor], epoch: float
                ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Each tensor's density and clipping scale this step: one group, or with
        ``small_density`` the large tensors and the small ones apart (each clipped by its own
        norm, as each of ``TwoDensityCompressor``'s compressors clips what it is given)."""
        groups: list[tuple[list[str], float]] = [(list(flat), self.config.density_at(epoch))]
        if self.small_density > 0.0:
            small = dataclasses.replace(self.config, density=self.small_density)
            groups = [([n for n, f in flat.items() if f.numel() > self.small_numel],
                       self.config.density_at(epoch)),
                      ([n for n, f in flat.items() if f.numel() <= self.small_numel],
                       small.density_at(epoch))]
        density_of: dict[str, float] = {}
        scale_of: dict[str, torch.Tensor] = {}
        for names, density in groups:
            squares = ([float(self._sum_squares.execute((flat[n],))[0]) for n in names]
                       if self.config.clip_norm is not None else [])
            scale = torch.tensor([clip_scale(squares, self.config)], dtype=torch.float32)
            for n in names:
                density_of[n], scale_of[n] = density, scale
        return density_of, scale_of

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was never applied back into the residual (host-side scatter-add,
        as :meth:`dgc.DGCCompressor.restore`)."""
        for name, t in update.tensors.items():
            if name not in self.v:
                raise StateError(f"update tensor {name!r} is not held by this encoder")
            n = self.v[name].numel()
            if t.numel != n:
                raise StateError(f"update tensor {name!r} has {t.numel} entries, the residual "
                                 f"holds {n}")
            if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= n):
                raise StateError(f"restore indices for {name!r} fall outside [0, {n})")
        for name, t in update.tensors.items():
            v = self._v_full[name].numpy().copy()
            np.add.at(v, t.indices.numpy(), t.values.to(torch.float32).numpy())
            self._keep(name, self._u_full[name], torch.from_numpy(v))

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values ``v`` (flat views of the encoder's state)."""
        return dict(self.v)

    def scale_state(self, factor: float) -> None:
        """Multiply ``v`` and ``u`` by ``factor`` in place (0 clears them)."""
        factor = check_factor(factor)
        for state in (self.v, self.u):
            for t in state.values():
                t.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        """Copies of the step counter, of ``u`` (tensors that have one) and of ``v``, as flat
        float32 numpy arrays."""
        return {"step": self.step,
                "u": {k: t.numpy().copy() for k, t in self.u.items() if k in self.started},
                "v": {k: t.numpy().copy() for k, t in self.v.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; validated whole before anything is replaced."""
        new: dict[str, dict[str, torch.Tensor]] = {}
        for part in ("u", "v"):
            held = state.get(part)
            if not isinstance(held, Mapping) or not set(held) <= set(self.shapes):
                raise StateError(f"encoder state {part!r} must map names among "
                                 f"{sorted(self.shapes)} to arrays")
            new[part] = {name: torch.zeros(math.prod(s)) for name, s in self.shapes.items()}
            for name, arr in held.items():
                a = np.asarray(arr, dtype=np.float32).reshape(-1)
                if a.size != math.prod(self.shapes[name]) or not np.isfinite(a).all():
                    raise StateError(f"encoder state {part}[{name!r}] must be finite with "
                                     f"{math.prod(self.shapes[name])} entries")
                new[part][name] = torch.from_numpy(a.copy())
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"encoder state step must be an integer >= 0, got {step!r}")
        for name in self.shapes:
            self._keep(name, new["u"][name], new["v"][name])
        self.step = step
        self.started = set(state["u"])


class PteTrainer:
    """Local training with ``train_step.pte``: forward and backward in ExecuTorch, then
    ExecuTorch's SGD optimizer.

    Parameters
    ----------
    export_dir : str or Path
        An export folder (manifest and ``train_step.pte``).
    learning_rate : float, optional
        SGD step size; the manifest's when omitted.
    """

    def __init__(self, export_dir: str | Path, learning_rate: float | None = None) -> None:
        from executorch.extension.training import (
            _load_for_executorch_for_training_from_buffer,
            get_sgd_optimizer,
        )

        start_threadpool()  # before the first method loads: quiet
        self.manifest = load_manifest(export_dir)
        t = self.manifest["training"]
        self.batch_shape = tuple(t["input_shape"])
        # Exports since issue 27 take any batch of 1..batch_size examples (a client's last
        # batch of an epoch is smaller); earlier ones exactly batch_size.
        self.min_batch = 1 if t.get("dynamic_batch") else self.batch_shape[0]
        self.momentum = self.weight_decay = 0.0
        self.learning_rate = float(t["learning_rate"] if learning_rate is None else learning_rate)
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise StateError(f"learning_rate must be positive and finite, got {learning_rate!r}")
        # The loaded program points into this buffer, which must outlive it (a freed buffer
        # crashes forward_backward).
        self._program_bytes = (Path(export_dir) / TRAIN_FILE).read_bytes()
        self._module = _load_for_executorch_for_training_from_buffer(self._program_bytes)
        # The training module hands out its parameter buffers only after one forward_backward;
        # this first call on a zero batch exists to obtain them, its gradients are never used.
        self._module.forward_backward("forward", (
            torch.zeros(self.batch_shape), torch.zeros(self.batch_shape[0], dtype=torch.int64)))
        self._params = {k.removeprefix(TRAIN_PREFIX): p
                        for k, p in self._module.named_parameters().items()}
        self._get_sgd_optimizer = get_sgd_optimizer
        self.set_learning_rate(self.learning_rate)

    def set_learning_rate(self, learning_rate: float, momentum: float = 0.0,
                          weight_decay: float = 0.0) -> None:
        """Use a fresh SGD optimizer: this step size, momentum (its buffers start empty, as a
        simulated client's ``torch.optim.SGD`` starts every round) and weight decay."""
        for name, value, low_open in (("learning_rate", learning_rate, True),
                                      ("momentum", momentum, False),
                                      ("weight_decay", weight_decay, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 or (low_open and value == 0):
                raise StateError(f"{name} must be a finite number {'>' if low_open else '>='} "
                                 f"0, got {value!r}")
        if momentum >= 1:
            raise StateError(f"momentum must be below 1, got {momentum!r}")
        self.learning_rate = float(learning_rate)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self._optimizer = self._get_sgd_optimizer(self._module.named_parameters(),
                                                  self.learning_rate, self.momentum, 0,
                                                  self.weight_decay, False)

    def set_parameters(self, params: Mapping[str, Any]) -> None:
        """Overwrite the program's parameters (all of them, validated first) in place."""
        arrays = {}
        for name, held in self._params.items():
            if name not in params:
                raise StateError(f"parameter {name!r} missing; expected {sorted(self._params)}")
            a = np.asarray(params[name], dtype=np.float32)
            if a.shape != tuple(held.shape):
                raise StateError(f"parameter {name!r} has shape {a.shape}, expected "
                                 f"{tuple(held.shape)}")
            arrays[name] = a
        for name, a in arrays.items():
            self._params[name].numpy()[...] = a

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters."""
        return {name: p.numpy().copy() for name, p in self._params.items()}

    def train(self, batches: Iterable[tuple[Any, Any]]) -> list[float]:
        """One SGD step per ``(x, y)`` batch (float32 inputs, int64 labels); the losses."""
        losses = []
        for x, y in batches:
            xa = np.ascontiguousarray(x, dtype=np.float32)
            ya = np.ascontiguousarray(y, dtype=np.int64)
            n = xa.shape[0] if xa.ndim else 0
            if not (self.min_batch <= n <= self.batch_shape[0]
                    and xa.shape[1:] == self.batch_shape[1:] and ya.shape == (n,)):
                lengths = (f"{self.min_batch}..{self.batch_shape[0]}"
                           if self.min_batch < self.batch_shape[0] else f"{self.min_batch}")
                raise StateError(f"batch must be x(n, {', '.join(map(str, self.batch_shape[1:]))}"
                                 f") and y(n,) with n in {lengths}, got x{xa.shape} and "
                                 f"y{ya.shape}")
            loss = self._module.forward_backward("forward",
                                                 (torch.from_numpy(xa), torch.from_numpy(ya)))
            self._optimizer.step(self._module.named_gradients())
            losses.append(float(loss[0]))
        return losses
