"""Models the exporter knows by name, with the example batch their training step is traced on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgc.errors import ConfigError
from fedgc.refs import is_ref
from fedgc.settings import TaskSpec
from fedgc.task_loader import load_task
from tasks import DATASETS


@dataclass(frozen=True)
class ModelSpec:
    """A model to export and the fixed batch layout of its on-device training step.

    Parameters
    ----------
    name : str
        Registry name (``--model`` on the command line).
    build : callable
        Returns a freshly initialised ``nn.Module`` mapping ``input_shape`` batches to logits.
    input_shape : tuple of int
        Shape of one example (without the batch dimension).
    num_classes : int
        Number of logits; labels are int64 class indices.
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int


class MLP(nn.Module):
    """A two-layer perceptron: Linear, ReLU, Linear."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


MODELS: dict[str, ModelSpec] = {
    # 8x8 digits (scikit-learn's load_digits): 2,410 parameters, fc1.weight (2,048) is sparsified.
    "mlp-digits": ModelSpec("mlp-digits", lambda: MLP(64, 32, 10), (64,), 10),
    # MNIST-sized input, the model of DGC_NOTES' measurements: 159,010 parameters.
    "mlp-mnist": ModelSpec("mlp-mnist", lambda: MLP(784, 200, 10), (784,), 10),
}


def get_model(name: str, task_options: str = "") -> ModelSpec:
    """The model ``name``: one registered here, a ``tasks`` dataset name, or a task of your own
    (``module:callable``, called with ``task_options``, a JSON object), each with its default
    model and the parameter names the federation's server uses; unknown is a ``ConfigError``.

    Naming a ``module:callable`` here imports and runs it: it is the exporting user's own
    choice, as a run's keys are the server's (``docs/threat_model.md``).
    """
    if name in MODELS:
        return MODELS[name]

    if name not in DATASETS and not is_ref(name):
        raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS) + sorted(DATASETS)} "
                          f"or a task of your own as 'module:callable'")
    return task_model(load_task(TaskSpec(name, "", "", "", task_options)), name)


def task_model(task: Any, name: str) -> ModelSpec:
    """The exportable model of a loaded ``tasks.Task`` (float32 inputs, class labels, the loss
    on the model's output); another is a ``ConfigError`` saying why phones cannot train it."""
    if not task.train_x.is_floating_point():
        raise ConfigError(f"model {name!r} takes {task.train_x.dtype} inputs; the exported "
                          f"training step takes float32 inputs only")
    if task.sequence_loss:
        raise ConfigError(f"task {name!r} trains on a sequence loss; the exported training "
                          f"step takes the cross-entropy of the model's output only")
    return ModelSpec(name, task.build_model, tuple(task.input_shape), int(task.num_classes))
