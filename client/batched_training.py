"""Local training of many clients at once: one round of every client, batched with torch.func.

:func:`fedgc.training.train_locally` trains one client; here the clients of a round train
together, each on its own data and its own copy of the model, in one ``vmap`` of ``grad``
(``torch.func.functional_call``) per step. The parameters of all clients are stacked along a
first dimension, and each client takes exactly the steps :func:`train_locally` takes:

1. its batches are drawn from the same seeded generator, epoch after epoch (the last batch of
   an epoch is short, a new epoch starts a new batch); shorter batches are padded and masked,
   so that each client's loss is the mean over its own samples;
2. a client whose round has fewer steps than the longest stops where its own round ends (its
   parameters and momentum are left as they are);
3. its SGD step is ``torch.optim.SGD``'s (weight decay, momentum whose buffer starts as the
   first gradient, ``p -= lr * step``), element by element.

So each client ends with the model train_locally gives it, up to the order of floating-point
sums inside the batched kernels (measured within 1e-5 after whole runs, tests/test_engines.py).

Models: those without buffers or recurrent layers whose loss is the task's cross-entropy (the
MLP and the CNN of :mod:`tasks.models`, and models of your own of that kind). The character
LSTM is not batched: ``torch.func`` has no batching rule for the fused LSTM kernel
(``aten::lstm`` with per-client weights), and its sequence loss is another loss; batching it
would take an LSTM written step by step (one ``bmm`` per gate and time step over the clients),
for which the gain is smaller (its time is in the 80-step recurrence, not in launches).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedgc.training import LocalResult, _diverged, steps_of

_RECURRENT = (nn.RNNBase,)


@dataclass
class BatchedClient:
    """One client of a batched round: the model it starts from, its data, its round's seed."""

    start: Mapping[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    seed: int


def unsupported(task: object, model: nn.Module) -> str | None:
    """Why ``model`` of ``task`` cannot be trained batched, or None when it can."""
    if getattr(task, "sequence_loss", False):
        return "its loss is a sequence loss (the character LSTM)"
    loss = getattr(task, "loss_fn", None)
    if not (type(loss) is nn.CrossEntropyLoss and loss.reduction == "mean"
            and loss.weight is None and loss.label_smoothing == 0.0
            and loss.ignore_index == -100):
        return "its loss is not the plain cross-entropy (task.loss_fn)"
    return unsupported_model(model)


def unsupported_model(model: nn.Module) -> str | None:
    """Why ``model`` cannot be trained batched (buffers, recurrent layers), or None."""
    recurrent = [type(m).__name__ for m in model.modules() if isinstance(m, _RECURRENT)]
    if recurrent:
        return f"it has recurrent layers ({', '.join(recurrent)}), which torch.func cannot batch"
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        return f"it has buffers ({', '.join(buffers[:3])}), which batched clients cannot update"
    return None


def batch_plan(n: int, batch_size: int, total: int, seed: int) -> torch.Tensor:
    """The sample positions of a client's ``total`` steps (rows), -1 where a batch is short:
    the batches :func:`fedgc.training.train_locally` draws from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(n / batch_size)
    epochs = math.ceil(total / per_epoch)
    rows = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        padded = torch.full((per_epoch * batch_size,), -1, dtype=torch.int64)
        padded[:n] = order
        rows.append(padded.view(per_epoch, batch_size))
    return torch.cat(rows)[:total]


def train_batched(model: nn.Module, clients: Sequence[BatchedClient], *, lr: float,
                  batch_size: int, local_epochs: int, local_steps: int, momentum: float = 0.0,
                  weight_decay: float = 0.0) -> list[LocalResult | FloatingPointError]:
    """Train every client of ``clients`` for one round, at once; their results in order.

    ``model`` gives the architecture (its own weights are not used) and the device. Each
    client's result is :func:`fedgc.training.train_locally`'s for the same arguments (its
    pseudo-gradient on the device), or the :class:`FloatingPointError` it would raise.
    """
    if not clients:
        return []
    reason = unsupported_model(model)
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot be trained batched: {reason}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    names = [name for name, _ in model.named_parameters()]
    sizes = [int(c.x.shape[0]) for c in clients]
    if min(sizes) == 0:
        raise ValueError("a client's partition is empty: nothing to train on")
    steps = [steps_of(n, batch_size, local_epochs, local_steps) for n in sizes]
    # Clients with more steps first: at step s the clients still training are a prefix, so a
    # step computes only theirs (views of the stacked parameters), as much work in all as
    # training them one at a time.
    order = sorted(range(len(clients)), key=lambda c: -steps[c])
    count, longest = len(order), steps[order[0]]
    training = [sum(1 for c in order if steps[c] > s) for s in range(longest)]
    # Every client's samples back to back, and each step's batch as positions in them.
    offsets = torch.tensor([0, *[sizes[c] for c in order][:-1]], dtype=torch.int64).cumsum(0)
    plan = torch.full((longest, count, batch_size), -1, dtype=torch.int64)
    for j, c in enumerate(order):
        plan[:steps[c], j] = batch_plan(sizes[c], batch_size, steps[c], clients[c].seed)
    valid = plan >= 0
    positions = torch.where(valid, plan + offsets.view(1, count, 1), 0).to(device)
    mask = valid.to(device, torch.float32)
    x = torch.cat([clients[c].x for c in order]).to(device)
    y = torch.cat([clients[c].y for c in order]).to(device)

    start = {k: torch.stack([clients[c].start[k].detach().to(device, torch.float32)
                             for c in order]) for k in names}
    params = {k: v.clone() for k, v in start.items()}
    buffers: dict[str, torch.Tensor] = {}

    def loss_of(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor,
                m: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (xb,))
        per_sample = nn.functional.cross_entropy(logits, yb, reduction="none")
        return (per_sample * m).sum() / m.sum().clamp(min=1.0)

    step_fn = vmap(grad_and_value(loss_of))
    losses = []
    was_training = model.training
    model.train()
    try:
        for s in range(longest):
            a = training[s]
            grads, loss = step_fn({k: v[:a] for k, v in params.items()},
                                  x[positions[s, :a]], y[positions[s, :a]], mask[s, :a])
            losses.append(loss)
            for k in names:  # torch.optim.SGD's step, in place on the training prefix
                g = grads[k]
                if weight_decay != 0:
                    g = g.add(params[k][:a], alpha=weight_decay)
                if momentum != 0:
                    if s == 0:
                        buffers[k] = g.clone()  # SGD's buffer starts as the first gradient
                    else:
                        buffers[k][:a].mul_(momentum).add_(g)
                    g = buffers[k][:a]
                params[k][:a].add_(g, alpha=-lr)
    finally:
        model.train(was_training)
    table = torch.cat(losses).tolist()  # the one read back of the round
    at = [sum(training[:s]) for s in range(longest)]  # where each step's losses start
    results: list[LocalResult | FloatingPointError] = [None] * count  # type: ignore[list-item]
    for j, c in enumerate(order):
        values = [table[at[s] + j] for s in range(steps[c])]
        bad = next((s for s, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            try:
                _diverged(bad, values[bad], lr)
            except FloatingPointError as ex:
                results[c] = ex
            continue
        loss_sum = 0.0
        for value in values:  # summed in order, in float64, as train_locally does
            loss_sum += value
        pseudo = {k: start[k][j] - params[k][j] for k in names}
        results[c] = LocalResult(pseudo, loss_sum / max(len(values), 1), sizes[c], steps[c])
    return results
