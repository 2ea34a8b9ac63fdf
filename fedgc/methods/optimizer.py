"""The server optimizer: momentum SGD on the round's averaged pseudo-gradient (FedAvgM's
convention), and the look-ahead direction the compressed broadcast follows.

The one implementation: the strategy steps with it, and a method that keeps its momentum
elsewhere (FetchSGD's sketches) returns one of its own settings from
:meth:`fedgc.methods.Method.optimizer`. It lives with the method contract so that methods import
it without importing the server.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

Model = OrderedDict[str, torch.Tensor]


class ServerOptimizer:
    """``buf = momentum * buf + avg; global -= learning_rate * buf`` (``torch.optim.SGD``'s and
    Flower FedAvgM's convention; without momentum ``global -= learning_rate * avg``).

    Parameters
    ----------
    learning_rate : float (default: 1.0)
        Server step size on the averaged pseudo-gradient.
    momentum : float (default: 0.0)
        Server momentum factor; 0 keeps no buffer.
    """

    def __init__(self, learning_rate: float = 1.0, momentum: float = 0.0) -> None:
        self.learning_rate = float(learning_rate)
        self.momentum = float(momentum)
        self.buffer: dict[str, torch.Tensor] | None = None

    def step(self, model: Mapping[str, torch.Tensor],
             avg: Mapping[str, torch.Tensor]) -> Model | None:
        """The next global model after ``avg`` (the weighted mean of ``global - local``), or
        None when it would not be finite; then the buffer keeps its value."""
        if self.momentum > 0.0:
            if self.buffer is None:
                self.buffer = {k: torch.zeros_like(v) for k, v in model.items()}
            step = {k: self.buffer[k] * self.momentum + avg[k] for k in avg}
        else:
            step = dict(avg)
        new = OrderedDict((k, v - self.learning_rate * step[k]) for k, v in model.items())
        if not all(torch.isfinite(t).all() for t in new.values()):
            return None
        if self.momentum > 0.0:
            self.buffer = step
        return new

    def heading(self, model: Model, lookahead: float) -> Model:
        """Where the momentum is taking ``model``: ``model - lookahead * lr * m * buf`` (the part
        of the next step the buffer already fixes, Nesterov's look-ahead); ``model`` itself
        without look-ahead or buffer."""
        if not lookahead or self.buffer is None:
            return model
        factor = lookahead * self.learning_rate * self.momentum
        return OrderedDict((k, v - factor * self.buffer[k]) for k, v in model.items())

    def state_dict(self) -> dict[str, Any]:
        """The buffer (the checkpoint's ``momentum_buffer``)."""
        return {"momentum_buffer": self.buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.buffer = state["momentum_buffer"]
