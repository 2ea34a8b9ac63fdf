"""Local training of one client round and the pseudo-gradient it produces (plain PyTorch).

Shared: the ClientApp trains with it (:mod:`client.app`), the server's FLTrust root update runs
a client round with it (:mod:`server.robust`), and phones draw their batches as it does
(:mod:`android_bridge.phone`), so all of them compute alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LocalResult:
    """What one round of local training produced.

    Parameters
    ----------
    pseudo_gradient : dict of str to Tensor
        ``global - local`` per floating-point tensor of the model's state dict. The sign makes it
        a descent direction like a gradient: the server applies ``global - server_lr * avg``, so
        with ``server_lr = 1`` and dense updates the new model is the FedAvg average.
    train_loss : float
        Mean minibatch loss over the round's local steps.
    num_examples : int
        Examples in the client's partition (the FedAvg weight).
    steps : int
        Local optimizer steps taken.
    """

    pseudo_gradient: dict[str, torch.Tensor]
    train_loss: float
    num_examples: int
    steps: int


def round_seed(seed: int, server_round: int, client_key: int) -> int:
    """A per-(run seed, round, client) seed, so reruns shuffle identically."""
    return (seed * 1_000_003 + server_round) * 1_000_003 + client_key


def train_locally(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    lr: float,
    batch_size: int,
    local_epochs: int,
    local_steps: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> LocalResult:
    """Train ``model`` in place on ``(x, y)`` and return the pseudo-gradient it moved by.

    ``loss_fn(model, xb, yb)`` is the loss of one minibatch (:meth:`tasks.Task.training_loss`).

    ``local_steps > 0`` takes exactly that many minibatch steps (cycling through reshuffled
    epochs); otherwise ``local_epochs`` full passes. A fresh SGD optimizer each round: client
    momentum does not survive between rounds (a client takes part rarely, and its momentum
    would be stale).

    Training runs where the model's parameters are (the data is moved there once); the losses
    are read back once, at the end, so that an accelerator never waits for the host between
    steps. A non-finite loss raises :class:`FloatingPointError` naming its step, as soon as the
    loss is seen: at that step on the host, after the last on an accelerator.
    """
    n = int(x.shape[0])
    if n == 0:
        raise ValueError("the client's partition is empty: nothing to train on")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    x, y = x.to(device), y.to(device)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout and any other module randomness
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)
    total_steps = steps_of(n, batch_size, local_epochs, local_steps)
    model.train()
    on_host = device.type == "cpu"
    losses: list[torch.Tensor] = []
    order = torch.randperm(n, generator=generator).to(device)
    cursor = 0
    while len(losses) < total_steps:
        if cursor >= n:
            order, cursor = torch.randperm(n, generator=generator).to(device), 0
        idx = order[cursor:cursor + batch_size]
        cursor += batch_size
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, x[idx], y[idx])
        if on_host and not torch.isfinite(loss):
            _diverged(len(losses), float(loss), lr)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    values = torch.stack(losses).tolist() if losses else []
    for step, value in enumerate(values):
        if not math.isfinite(value):
            _diverged(step, value, lr)
    loss_sum = 0.0
    for value in values:  # summed in order, in float64, whatever the device
        loss_sum += value
    return LocalResult(pseudo_gradient(start, model.state_dict()), loss_sum / max(len(values), 1),
                       n, len(values))


def steps_of(n: int, batch_size: int, local_epochs: int, local_steps: int) -> int:
    """Local steps of a round on ``n`` samples: ``local_steps``, else ``local_epochs`` passes."""
    return local_steps if local_steps > 0 else local_epochs * math.ceil(n / batch_size)


def _diverged(step: int, loss: float, lr: float) -> None:
    raise FloatingPointError(f"local training diverged at step {step}: loss {loss} "
                             f"(lower lr, now {lr})")


def pseudo_gradient(global_state: Mapping[str, torch.Tensor],
                    local_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``global - local`` for every floating-point tensor (integer buffers are not updates)."""
    return {k: (global_state[k].float() - local_state[k].detach().float())
            for k, v in global_state.items() if v.is_floating_point()}
