"""The models fedgc trains: an MLP, a small CNN and a character LSTM, built by name."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tasks.errors import DataError


class MLP(nn.Module):
    """Fully connected ReLU network on flattened inputs.

    Parameters
    ----------
    in_features : int
        Flattened input size, e.g. 784 for 28x28 images.
    num_classes : int
        Number of output logits.
    hidden : Sequence[int]
        Widths of the hidden layers; the default ``(200,)`` gives the 784-200-10 MLP of
        DGC_NOTES.md.
    """

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (200,)) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two conv(5x5, same padding)-ReLU-maxpool(2) blocks, one hidden dense layer, logits.

    Sized for CPU training: the defaults give about 0.2M parameters on 28x28x1 and 0.27M on
    32x32x3 (LEAF's FEMNIST CNN has 32/64 channels and a 2048-wide layer, 6.6M parameters).

    Parameters
    ----------
    in_channels, height, width : int
        Input image layout (C, H, W); height and width must be >= 4 (two 2x poolings).
    num_classes : int
        Number of output logits.
    channels : tuple[int, int]
        Output channels of the two conv layers.
    hidden : int
        Width of the dense layer.
    """

    def __init__(
        self,
        in_channels: int,
        height: int,
        width: int,
        num_classes: int,
        channels: tuple[int, int] = (16, 32),
        hidden: int = 128,
    ) -> None:
        super().__init__()
        if height < 4 or width < 4:
            raise DataError(f"CNN needs images of at least 4x4, got {height}x{width}")
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        flat = c2 * (height // 2 // 2) * (width // 2 // 2)
        self.classifier = nn.Sequential(
            nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CharLSTM(nn.Module):
    """Next-character model as in LEAF's Shakespeare: embedding, stacked LSTM, logits of last step.

    Parameters
    ----------
    vocab_size : int
        Number of distinct characters (input ids and output classes).
    embedding_dim : int
        Character embedding width (LEAF: 8).
    hidden : int
        LSTM hidden size; LEAF uses 256, the default 128 keeps CPU rounds short.
    num_layers : int
        Stacked LSTM layers (LEAF: 2).
    """

    def __init__(
        self, vocab_size: int, embedding_dim: int = 8, hidden: int = 128, num_layers: int = 2
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq_len) int64 character ids -> (batch, vocab_size) logits of the next char.
        out, _ = self.lstm(self.embedding(x))
        return self.head(out[:, -1, :])

    def sequence_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the character after every position: (batch, seq_len, vocab_size).

        One pass of the LSTM yields a prediction at each of the ``seq_len`` steps; training on
        all of them (:meth:`tasks.Task.training_loss`) gives ``seq_len`` times the signal of the
        last step alone for about the same compute.
        """
        out, _ = self.lstm(self.embedding(x))
        return self.head(out)


MODELS = ("mlp", "cnn", "lstm")


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, **options: object
) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` (one sample) and ``num_classes`` outputs.

    ``options`` go to the model's constructor (e.g. ``hidden=(100,)`` for the MLP). The weights
    come from torch's global RNG, so ``torch.manual_seed`` makes them reproducible.

    Raises
    ------
    DataError
        On an unknown model name, an input shape the model cannot take, or an unknown option.
    """
    if name not in MODELS:
        raise DataError(f"unknown model {name!r}; expected one of {list(MODELS)}")
    try:
        if name == "mlp":
            return MLP(math.prod(input_shape), num_classes, **options)
        if name == "cnn":
            if len(input_shape) != 3:
                raise DataError(
                    f"model 'cnn' needs image inputs (C, H, W), got input_shape {input_shape}"
                )
            return CNN(*input_shape, num_classes=num_classes, **options)
        if len(input_shape) != 1:
            raise DataError(
                f"model 'lstm' needs character sequences (seq_len,), got input_shape {input_shape}"
            )
        return CharLSTM(num_classes, **options)
    except TypeError as exc:  # an option the constructor does not take
        raise DataError(f"bad option for model {name!r}: {exc}") from exc
