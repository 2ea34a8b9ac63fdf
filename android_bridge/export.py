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

import dataclasses
import hashlib
import json
import math
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
from android_bridge.models import ModelSpec, get_model
from dgc.config import DGCConfig
from dgc.errors import ConfigError

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
    """The joint forward/backward ExecuTorch program of ``model`` for batches of ``batch_size``.

    Built with ``torch.export`` and ``torch.export.experimental._export_forward_backward`` (the
    ExecuTorch training flow); its parameters start as ``model``'s and are outputs of the method,
    so the host can overwrite them with the global model before training.
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    x = torch.zeros((batch_size, *spec.input_shape))
    y = torch.zeros(batch_size, dtype=torch.int64)
    ep = export(TrainingStep(model), (x, y), strict=True)
    ep = _export_forward_backward(ep)
    return to_edge(ep).to_executorch(ExecutorchBackendConfig()).buffer


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
    """What a default fedgc run (``method = "dgc"``, ``fedgc.settings.TrainSettings()``) asks
    a phone for: the DGC config (exact selection, as phones run), batch size and learning rate,
    and the run-config keys (``--run-config`` / pyproject) whose values the export bakes in."""
    from fedgc.methods import get
    from fedgc.settings import TrainSettings

    s = TrainSettings()
    config = exact_config(get(s.method).phone_config(s))
    return {"task": s.task, "config": config, "batch_size": s.batch_size,
            "learning_rate": s.lr, "run_config": _run_config_keys(config, s.batch_size, s.lr)}


def _run_config_keys(config: DGCConfig, batch_size: int, learning_rate: float
                     ) -> dict[str, Any]:
    # The server keys a run must set for this export's phones to take its tasks: the baked DGC
    # fields (check_compatible refuses any other value) and the fixed training batch. lr is
    # sent with every task and applied as sent; it is listed as the default the export assumed.
    return {"method": "dgc", "batch_size": batch_size, "lr": learning_rate,
            "dgc.momentum": config.momentum, "dgc.momentum_correction": config.momentum_correction,
            "dgc.nesterov": config.nesterov, "dgc.dampening": config.dampening,
            "dgc.momentum_masking": config.momentum_masking,
            "dgc.value_dtype": config.value_dtype, "dgc.ternary": config.ternary}


#: What the manifest tells a phone developer about reaching the federation.
BRIDGE_NOTES = {
    "address": "host:port of the bridge's gRPC server (TLS only), e.g. bridge.example.org:8443; "
               "the server side sets it with node config bridge-address",
    "tls": "the phone pins the CA that signed the bridge's certificate (node config "
           "bridge-cert); plaintext is refused",
    "identity": "device id and token, one pair per phone in the bridge's bridge-devices JSON "
                "file; Register(device_id, token, manifest_sha256) opens a session",
    "proto": "android_bridge/proto/fedgc_bridge.proto (service FedgcBridge)",
    "wire_format": "android_bridge/WIRE_FORMAT.md",
}


def export_all(model_name: str | None, out_dir: str | Path, config: DGCConfig | None = None,
               batch_size: int | None = None, learning_rate: float | None = None,
               seed: int = 0, max_numel: int = DEFAULT_MAX_NUMEL) -> dict[str, Any]:
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
    spec = get_model(model_name)
    torch.manual_seed(seed)
    model = spec.build()
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
            "run_config": _run_config_keys(config, batch_size, learning_rate),
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
