"""Export of the DGC encoder and a local training step to ExecuTorch and TorchScript files.

:func:`export_all` writes into one folder:

``encoder.pte``
    ExecuTorch program (XNNPACK partitioner, dynamic length) with methods ``encode``,
    ``encode_blocked``, ``encode_dense`` and ``sum_squares``; the contract is in
    :mod:`android_bridge.encoder`.
``encoder.pt``
    ``encode``, ``encode_dense`` and ``sum_squares`` as a TorchScript module (``forward`` is
    ``encode``).
``train_step.pte``
    The model's joint forward/backward graph (ExecuTorch training API); the host runs it with
    ``executorch.extension.training`` and applies that runtime's SGD optimizer.
``manifest.json``
    Parameter names, shapes and dtypes, the layer policy, the batch layout, the DGC config, the
    method contracts, file digests and the versions of torch, executorch and fedgc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from android_bridge.encoder import (
    BLOCK,
    BlockSparseStepEncoder,
    DenseStepEncoder,
    SparseStepEncoder,
    SumSquares,
    check_exportable,
)
from android_bridge.initial_model import initial_digests
from android_bridge.models import ModelSpec, get_model, task_model
from dgc.config import DGCConfig
from dgc.errors import ConfigError
from fedgc import methods
from fedgc.keys import ServerSettings
from fedgc.schema import SettingsError, coerce
from fedgc.settings import RunConfig
from fedgc.task_loader import load_task

MANIFEST_VERSION = 1
#: Longest flat tensor the exported encoder accepts by default. ExecuTorch plans memory for the
#: upper bound of a dynamic dimension, so this bounds the encoder's arena (about 17 floats each).
DEFAULT_MAX_NUMEL = 2**21
ENCODER_FILE = "encoder.pte"
TORCHSCRIPT_FILE = "encoder.pt"
TRAIN_FILE = "train_step.pte"
MANIFEST_FILE = "manifest.json"
TRAIN_PREFIX = "net."


class _ScriptedEncoder(nn.Module):
    """The three encoder methods in one module, for ``torch.jit.script``."""

    def __init__(self, config: DGCConfig) -> None:
        super().__init__()
        self.sparse = SparseStepEncoder(config)
        self.dense = DenseStepEncoder(config)
        self.squares = SumSquares()

    def forward(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                fresh: torch.Tensor, k_like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sparse(grad, u, v, scale, fresh, k_like)

    @torch.jit.export
    def encode_dense(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                     scale: torch.Tensor, fresh: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense(grad, u, v, scale, fresh)

    @torch.jit.export
    def sum_squares(self, grad: torch.Tensor) -> torch.Tensor:
        return self.squares(grad)


class TrainingStep(nn.Module):
    """The model with its loss: ``(x, y) -> (loss, predicted class)``, loss first as ExecuTorch's
    training API requires."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return self.loss(logits, y), logits.detach().argmax(dim=1)


class _Conv1dAs2d(nn.Module):
    """A ``Conv1d`` run as a ``Conv2d`` of height 1, holding the same parameters under the same
    names and shapes: ExecuTorch's portable ``convolution_backward`` kernel computes 2-D
    convolutions only ("Only 2D Convolution Backward supported"), so a 1-D one would export and
    then fail on the phone's first training step."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.dilation = (1, conv.stride[0]), (1, conv.dilation[0])
        self.groups = conv.groups
        # A padding mode other than zeros pads first, as Conv1d itself does.
        self.pad = None if conv.padding_mode == "zeros" else (
            conv._reversed_padding_repeated_twice, conv.padding_mode)
        self.padding: str | tuple[int, int] = (
            conv.padding if isinstance(conv.padding, str) else (0, conv.padding[0]))
        if self.pad is not None:
            self.padding = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad is not None:
            x = nn.functional.pad(x, self.pad[0], mode=self.pad[1])
        return nn.functional.conv2d(x.unsqueeze(-2), self.weight.unsqueeze(-2), self.bias,
                                    self.stride, self.padding, self.dilation,
                                    self.groups).squeeze(-2)


class _WindowMax(nn.Module):
    """Max pooling over non-overlapping windows (kernel = stride, no padding, no dilation) as a
    reshape and ``max`` over each window: the gradient goes to the window's first largest entry,
    as ``max_pool``'s does. ExecuTorch's ``max_pool2d_with_indices_backward`` kernel returns
    wrong gradients (tens where eager torch gives tenths), so a pooled model would train
    differently on the phone."""

    def __init__(self, kernel: tuple[int, ...]) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.kernel) == 1:
            (k,) = self.kernel
            n = x.shape[-1] // k
            return x[..., :n * k].unflatten(-1, (n, k)).max(-1).values
        k1, k2 = self.kernel
        h, w = x.shape[-2] // k1, x.shape[-1] // k2
        x = x[..., :h * k1, :w * k2].unflatten(-1, (w, k2)).unflatten(-3, (h, k1))
        return x.transpose(-3, -2).flatten(-2).max(-1).values


def _window_max(pool: nn.Module) -> _WindowMax | None:
    """The :class:`_WindowMax` of a ``MaxPool1d``/``MaxPool2d`` of non-overlapping windows;
    None for other pools (the export's gradient check judges those)."""
    dims = 1 if isinstance(pool, nn.MaxPool1d) else 2

    def pair(v: Any) -> tuple[int, ...]:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims

    kernel = pair(pool.kernel_size)
    stride = pair(pool.stride if pool.stride is not None else pool.kernel_size)
    if (stride != kernel or any(pair(pool.padding)) or set(pair(pool.dilation)) != {1}
            or pool.ceil_mode or pool.return_indices):
        return None
    return _WindowMax(kernel)


def _phone_ops(model: nn.Module) -> nn.Module:
    """``model``, or a copy whose layers that ExecuTorch's kernels cannot differentiate (as
    eager torch does) are rewritten into equivalents: ``Conv1d`` as a 2-D convolution
    (:class:`_Conv1dAs2d`: the same parameter names, shapes and values) and max pooling over
    non-overlapping windows (:class:`_WindowMax`)."""
    def rewrite(module: nn.Module) -> nn.Module | None:
        if isinstance(module, nn.Conv1d):
            return _Conv1dAs2d(module)
        if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d)):
            return _window_max(module)
        return None

    if not any(rewrite(m) is not None for m in model.modules()):
        return model
    import copy

    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        replacement = rewrite(module)
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    replacement)
    return model


@contextlib.contextmanager
def _native_stderr() -> Iterator[Callable[[], str]]:
    """Standard error into a buffer for the block, file descriptor 2 (what native code writes)
    and ``sys.stderr`` (the ExecuTorch bindings log through it when it is not the process's
    own, as under pytest); yields a function that reads what was written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink, contextlib.redirect_stderr(io.StringIO()) as text:
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1] \
                + text.getvalue()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _check_step(program: bytes, spec: ModelSpec, model: nn.Module,
                batch_sizes: tuple[int, ...]) -> None:
    """Run one training step of ``program`` on a random batch of each size in the ExecuTorch
    runtime and compare its gradients with eager torch's on ``model``: a step that fails (an
    operator its kernels lack) or computes other gradients (a wrong kernel) raises
    ``ConfigError`` at export, not on a phone."""
    import copy

    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    eager = TrainingStep(copy.deepcopy(model))
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn((n, *spec.input_shape), generator=generator),
                torch.randint(spec.num_classes, (n,), generator=generator)) for n in batch_sizes]
    # The runtime logs to the process's stderr (its CPU probe at load, the failed check of a
    # kernel): kept out of the export command's output, and the failure named in the error.
    grads: list[dict[str, torch.Tensor]] = []
    with _native_stderr() as log:
        module = _load_for_executorch_for_training_from_buffer(program)
        for x, y in batches:
            try:
                module.forward_backward("forward", (x, y))
            except RuntimeError as ex:
                checks = [line.split("] ", 1)[-1] for line in log().splitlines()
                          if "Check failed" in line or "KernelCall failed" in line]
                raise ConfigError(f"model {spec.name!r}: its exported training step does not "
                                  f"run in the ExecuTorch runtime (a batch of {len(x)}: {ex}; "
                                  f"{' / '.join(checks[:2]) or 'no log'})") from ex
            grads.append({k: g.clone() for k, g in module.named_gradients().items()})
    for (x, y), got in zip(batches, grads, strict=True):
        eager.zero_grad()
        eager(x, y)[0].backward()
        wrong = []
        for name, p in eager.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)
            # float32 sums in another order differ by ~1e-7 of the largest gradient.
            if (got[name] - want).abs().max() > 1e-4 * (1.0 + float(want.abs().max())):
                wrong.append(name.removeprefix(TRAIN_PREFIX))
        if wrong:
            raise ConfigError(f"model {spec.name!r}: ExecuTorch's kernels compute other "
                              f"gradients than torch for {wrong} (a batch of {len(x)}); a layer "
                              f"they differentiate wrongly (max pooling with overlapping "
                              f"windows?) cannot train on a phone")


def _check_max_numel(max_numel: int) -> None:
    if isinstance(max_numel, bool) or not isinstance(max_numel, int) or max_numel < 2:
        raise ConfigError(f"max_numel must be an integer >= 2, got {max_numel!r}")


def export_encoder(config: DGCConfig, max_numel: int = DEFAULT_MAX_NUMEL) -> bytes:
    """The ExecuTorch program (bytes of a ``.pte``) with ``encode``, ``encode_blocked``,
    ``encode_dense`` and ``sum_squares`` for flat tensors of 1 to ``max_numel`` entries
    (``encode_blocked``: padded to a multiple of :data:`android_bridge.encoder.BLOCK`)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from torch.export import Dim, export

    check_exportable(config)
    _check_max_numel(max_numel)
    n_dim = Dim("numel", min=1, max=max_numel)
    k_dim = Dim("k", min=1, max=max_numel)
    max_blocks = -(-max_numel // BLOCK)
    blocks = Dim("blocks", min=1, max=max_blocks)
    n = 64
    grad, u, v, scale = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.ones(1)
    fresh = torch.ones(1)
    flat = {0: n_dim}
    padded = {0: BLOCK * blocks}
    programs = {
        "encode": export(SparseStepEncoder(config), (grad, u, v, scale, fresh, torch.zeros(4)),
                         dynamic_shapes=(flat, flat, flat, None, None, {0: k_dim})),
        "encode_blocked": export(
            BlockSparseStepEncoder(config),
            (torch.randn(n * BLOCK), torch.zeros(n * BLOCK), torch.zeros(n * BLOCK), scale, fresh,
             torch.zeros(4)),
            dynamic_shapes=(padded, padded, padded, None, None,
                            {0: Dim("k_blocked", min=1, max=max_blocks)})),
        "encode_dense": export(DenseStepEncoder(config), (grad, u, v, scale, fresh),
                               dynamic_shapes=(flat, flat, flat, None, None)),
        "sum_squares": export(SumSquares(), (grad,), dynamic_shapes=(flat,)),
    }
    lowered = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
    # Inputs are not planned: the runtime reads the caller's buffers instead of copying them in.
    # The reinplace pass lets index_put write into the step's own buffer instead of a copy.
    backend = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        run_reinplace_pass=True)
    return lowered.to_executorch(backend).buffer


def export_torchscript(config: DGCConfig, path: str | Path) -> None:
    """Write the encoder as a scripted TorchScript module (``torch.jit.load`` reads it back).

    ``torch.utils.mobile_optimizer.optimize_for_mobile`` is not applied: it needs XNNPACK in the
    torch build, which the CPU wheel pinned here lacks.
    """
    check_exportable(config)
    torch.jit.script(_ScriptedEncoder(config)).save(str(path))


def export_training_step(spec: ModelSpec, model: nn.Module, batch_size: int) -> bytes:
    """The joint forward/backward ExecuTorch program of ``model`` for batches of 1 to
    ``batch_size`` examples.

    Built with ``torch.export`` and ``torch.export.experimental._export_forward_backward`` (the
    ExecuTorch training flow); its parameters start as ``model``'s and are outputs of the method,
    so the host can overwrite them with the global model before training. The batch dimension
    is dynamic (memory planned for ``batch_size``): a simulated client's last batch of an epoch
    holds the examples left over, and the phone takes the same batches. Layers ExecuTorch's
    kernels do not differentiate as torch does are rewritten (:func:`_phone_ops`: ``Conv1d``,
    max pooling); the program runs once on random batches of ``batch_size`` and 1 and its
    gradients are checked against eager torch's before it is returned (``ConfigError`` when
    it does not run or differs).
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from torch.export import Dim, export
    from torch.export.experimental import _export_forward_backward

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    x = torch.zeros((batch_size, *spec.input_shape))
    y = torch.zeros(batch_size, dtype=torch.int64)
    # torch.export specialises a dimension whose upper bound is 1: a batch of 1 stays static.
    batch = Dim("batch", min=1, max=batch_size) if batch_size > 1 else None
    dynamic = ({0: batch}, {0: batch}) if batch is not None else None
    ep = export(TrainingStep(_phone_ops(model)), (x, y), dynamic_shapes=dynamic, strict=True)
    ep = _export_forward_backward(ep)
    program = to_edge(ep).to_executorch(ExecutorchBackendConfig()).buffer
    _check_step(program, spec, model, (batch_size, 1) if batch_size > 1 else (1,))
    return program


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parameter_layout(model: nn.Module, config: DGCConfig) -> list[dict[str, Any]]:
    """Name, shape, dtype, size and layer policy (sent dense or sparse) of every parameter."""
    out = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        numel = math.prod(shape)
        dense = config.sends_dense(shape)
        out.append({"name": name, "shape": shape, "dtype": str(p.dtype).removeprefix("torch."),
                    "numel": numel, "dense": dense})
    return out


def federation_defaults() -> dict[str, Any]:
    """What a default fedgc run (``method = "dgc"``, every key at its default) asks a phone
    for: the DGC config (exact selection, as phones run), batch size and learning rate, and
    the run-config keys (``--run-config`` / pyproject) whose values the export bakes in."""
    run = RunConfig.from_flat({"run_name": "federation-defaults"})
    s = run.train
    config = exact_config(phone_config(run))
    return {"task": s.task, "config": config, "batch_size": s.batch_size,
            "learning_rate": s.lr, "run_config": _run_config_keys(config, s.batch_size, s.lr)}


def phone_config(run: RunConfig) -> DGCConfig:
    """The DGC configuration a phone's encoder runs for ``run``'s method
    (:meth:`fedgc.methods.PhoneExport.phone_config`); ConfigError naming the methods phones
    run when phones do not run it."""
    return _served(run.method).phone_config(run.train)


def _served(method: methods.Method) -> methods.PhoneExport:
    # One refusal for export, the bridge and deploy: what the method needs that phones lack.
    part = methods.phone_export_of(method)
    if part is None:
        raise ConfigError(str(methods.phone_refusal(method)))
    return part


def _run_config_keys(config: DGCConfig, batch_size: int, learning_rate: float,
                     method: str = "dgc") -> dict[str, Any]:
    # The server keys a run must set for this export's phones to take its tasks: the baked DGC
    # fields (check_compatible refuses any other value) and the fixed training batch. lr is
    # sent with every task and applied as sent; it is listed as the default the export assumed.
    return {"method": method, "batch_size": batch_size, "lr": learning_rate,
            "dgc.momentum": config.momentum, "dgc.momentum_correction": config.momentum_correction,
            "dgc.nesterov": config.nesterov, "dgc.dampening": config.dampening,
            "dgc.momentum_masking": config.momentum_masking,
            "dgc.value_dtype": config.value_dtype, "dgc.ternary": config.ternary}


#: What the manifest tells a phone developer about reaching the federation.
BRIDGE_NOTES = {
    "address": "host:port of the bridge's gRPC server (TLS only off loopback), e.g. "
               "bridge.example.org:8443: `python -m android_bridge serve --listen`",
    "tls": "the phone pins the CA that signed the bridge's certificate (serve --cert); "
           "plaintext is refused",
    "identity": "device id and token, one pair per phone in the bridge's devices JSON file "
                "(serve --devices); Register(device_id, token, manifest_sha256) opens a session",
    "proto": "android_bridge/proto/fedgc_bridge.proto (service FedgcBridge)",
    "wire_format": "android_bridge/WIRE_FORMAT.md",
}


def export_all(model_name: str | ModelSpec | None, out_dir: str | Path,
               config: DGCConfig | None = None, batch_size: int | None = None,
               learning_rate: float | None = None, seed: int = 0,
               max_numel: int = DEFAULT_MAX_NUMEL,
               run_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the encoder (``.pte`` and ``.pt``), the training step and the manifest; return it.

    Every argument left ``None`` takes the federation's default (:func:`federation_defaults`):
    the default task's model, its DGC config with exact selection, its batch size and learning
    rate, so that a phone exported with no options takes a default run's tasks. A config with
    another selection is refused (see :func:`android_bridge.encoder.check_exportable`). ``seed``
    fixes the initial parameters baked into ``train_step.pte``: version 0 of a run of that seed,
    which the phone may start from (the manifest's ``initial_model`` names it by digest, as
    built and on the int8 broadcast grid: :mod:`android_bridge.initial_model`).
    """
    if model_name is None or config is None or batch_size is None or learning_rate is None:
        defaults = federation_defaults()
        model_name = defaults["task"] if model_name is None else model_name
        config = defaults["config"] if config is None else config
        batch_size = defaults["batch_size"] if batch_size is None else batch_size
        learning_rate = defaults["learning_rate"] if learning_rate is None else learning_rate
    check_exportable(config)
    _check_max_numel(max_numel)
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate)
            and learning_rate > 0):
        raise ConfigError(f"learning_rate must be a positive finite number, got "
                          f"{learning_rate!r}")
    spec = model_name if isinstance(model_name, ModelSpec) else get_model(model_name)
    torch.manual_seed(seed)
    model = spec.build()
    params = {name for name, _ in model.named_parameters()}
    buffers = [k for k, v in model.state_dict().items()
               if k not in params and v.is_floating_point()]
    if buffers:
        raise ConfigError(f"model {spec.name!r} has floating-point buffers {buffers} (batch "
                          f"norm statistics?): the server sends them, the exported training "
                          f"step trains parameters only")
    layout = parameter_layout(model, config)
    too_long = [p["name"] for p in layout if p["numel"] > max_numel]
    if too_long:
        raise ConfigError(f"parameters {too_long} have more than max_numel={max_numel} entries")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    encoder = export_encoder(config, max_numel)
    initial = initial_digests(model.state_dict())
    train = export_training_step(spec, model, batch_size)
    (out / ENCODER_FILE).write_bytes(encoder)
    (out / TRAIN_FILE).write_bytes(train)
    export_torchscript(config, out / TORCHSCRIPT_FILE)

    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "model": spec.name,
        "parameters": layout,
        "dgc_config": config.to_dict(),
        "encoder": {
            "file": ENCODER_FILE, "sha256": _sha256(encoder), "max_numel": max_numel,
            "methods": {
                "encode": {"inputs": ["grad f32[n]", "u f32[n]", "v f32[n]", "scale f32[1]",
                                      "fresh f32[1] (1.0 on the tensor's first step)",
                                      "k_like f32[k], 1 <= k <= n (only its length is read)"],
                           "outputs": ["indices i64[k]", f"values {config.value_dtype}[k]",
                                       "count i64[] (indices[:count], values[:count] are "
                                       "sent, sorted by index)", "u f32[n]", "v f32[n]"]},
                "encode_blocked": {"block": BLOCK,
                                   "inputs": ["grad f32[n], n a multiple of block (zero padded)",
                                              "u f32[n]", "v f32[n]", "scale f32[1]",
                                              "fresh f32[1]",
                                              "k_like f32[k], 1 <= k <= n / block"],
                                   "outputs": ["as encode"]},
                "encode_dense": {"inputs": ["grad f32[n]", "u f32[n]", "v f32[n]",
                                            "scale f32[1]", "fresh f32[1]"],
                                 "outputs": [f"values {config.value_dtype}[n]", "u f32[n]",
                                             "v f32[n]"]},
                "sum_squares": {"inputs": ["grad f32[n]"], "outputs": ["sum of squares f64[]"]},
            },
        },
        "torchscript": {"file": TORCHSCRIPT_FILE,
                        "sha256": _sha256((out / TORCHSCRIPT_FILE).read_bytes()),
                        "methods": ["forward (= encode)", "encode_dense", "sum_squares"]},
        "training": {
            "file": TRAIN_FILE, "sha256": _sha256(train), "method": "forward",
            "parameter_prefix": TRAIN_PREFIX, "batch_size": batch_size,
            "input_shape": [batch_size, *spec.input_shape], "input_dtype": "float32",
            # The first dimension of input_shape and label_shape is any of 1..batch_size.
            "dynamic_batch": batch_size > 1,
            "label_shape": [batch_size], "label_dtype": "int64",
            "num_classes": spec.num_classes, "loss": "cross_entropy (mean)",
            "outputs": ["loss f32[]", "predicted class i64[batch]"],
            "optimizer": "executorch.extension.training SGD", "learning_rate": learning_rate,
            "seed": seed,
        },
        "initial_model": {
            "seed": seed, **initial,
            "note": "train_step.pte's parameters as exported are version 0 of a run with this "
                    "seed (sha256: as built; int8_grid_sha256: rounded to the int8 broadcast "
                    "grid); a phone that holds no model offers these digests and is sent a "
                    "patch on the version 0 that has one of them",
        },
        "federation": {
            "run_config": _run_config_keys(config, batch_size, learning_rate,
                                           str((run_config or {}).get("method", "dgc"))),
            # export_run: the run's keys the model and version 0 were made from (informative;
            # the phone checks the model's tensors it is sent against "parameters").
            "made_for": run_config or {},
            "note": "a run whose train messages carry other values for these keys is refused by "
                    "the phone (re-export with them); the server's remaining keys are sent with "
                    "every task (train: lr, local_steps/local_epochs, seed; dgc: density, warm-up)",
        },
        "bridge": BRIDGE_NOTES,
        "versions": {"torch": torch.__version__, "executorch": _version("executorch"),
                     "fedgc": _version("fedgc"), "manifest": MANIFEST_VERSION},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def exact_config(config: DGCConfig) -> DGCConfig:
    """``config`` with ``selection="exact"``: the form the exported encoder implements."""
    return dataclasses.replace(config, selection="exact")


#: Why phones cannot take part in a secure round (docs/android.md, docs/privacy.md).
PHONE_SECAGG_REFUSAL = (
    "privacy.secagg = true: phones behind the bridge do not run secure aggregation (their app "
    "has no SecAgg+ stages: no X25519 key agreement, Shamir shares or masks, and the bridge's "
    "protocol no message for them; phones run {methods}); run it with SuperNodes only")


def check_phone_privacy(values: Mapping[str, object]) -> None:
    """``ConfigError`` (one line, :data:`PHONE_SECAGG_REFUSAL`) when the run's flat keys
    ``values`` turn on secure aggregation: checked before the run's config is built, so that
    a run with phones is refused for what phones lack, not for its method."""
    raw = values.get("privacy.secagg", False)
    try:
        secure = coerce("privacy.secagg", raw, bool)
    except SettingsError as ex:
        raise ConfigError(str(ex)) from ex
    if secure:
        raise ConfigError(PHONE_SECAGG_REFUSAL.format(methods=", ".join(methods.phone_methods())))


def check_phone_run(method: methods.Method,
                    server: ServerSettings | None = None) -> methods.PhoneExport:
    """The method's phone export part; ``ConfigError`` when phones cannot run a client of this
    run as a simulated client does: a method phones do not serve (naming those they do), or one
    of its own keys set to what phones do not run
    (:meth:`fedgc.methods.PhoneExport.phone_refusals`, from the configured ``method``).

    No key of the run's ``server`` is refused: phones join patches ranked by displacement
    (``downlink_context``) on the model they hold and read compact patches (``downlink_compact``)
    on that model's layout (:func:`fedgc.patching.decode_patch`), whose differences the bridge
    rewrites as values in the same form. ``server`` stays so that callers pass the whole run."""
    part = _served(method)
    set_ = part.phone_refusals()
    if set_:
        raise ConfigError(f"{', '.join(set_)}: phones run dgc's default client and not this "
                          f"switch (docs/android.md); leave it at its default in a run with "
                          f"phones")
    return part


def export_run(config: Any, out_dir: str | Path, max_numel: int | None = None,
               dgc_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export the phone files for the run of ``config`` (a :class:`fedgc.settings.RunConfig`).

    Everything comes from the run's keys: its task (a shipped one or ``module:callable`` with
    its ``task_options``, ``model`` and ``model_options``), the DGC config its method gives
    phones (:meth:`fedgc.methods.PhoneExport.phone_config`, with ``dgc_fields`` laid over it),
    ``batch_size`` (the largest batch the training step takes), ``lr`` and ``seed`` (the
    parameters baked into ``train_step.pte`` are the run's version 0). ``max_numel`` defaults to
    the model's largest tensor (the encoder's memory plan is sized by it). A method phones do
    not run is a ``ConfigError`` naming the ones they do.
    """
    check_phone_run(config.method, config.server)
    t = config.train
    phone = exact_config(phone_config(config))
    if dgc_fields:
        phone = DGCConfig.from_dict({**phone.to_dict(), **dgc_fields})
    spec = task_model(load_task(t.task_spec()), t.task)
    if max_numel is None:
        torch.manual_seed(t.seed)
        max_numel = max(2, max(p.numel() for p in spec.build().parameters()))
    keys = {"task": t.task, "task_options": t.task_options, "model": t.model,
            "model_options": t.model_options, "seed": t.seed, "method": t.method}
    return export_all(spec, out_dir, phone, batch_size=t.batch_size, learning_rate=t.lr,
                      seed=t.seed, max_numel=max_numel, run_config=keys)
