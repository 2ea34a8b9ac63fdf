"""The batched engine (``sim.engine=batched``): a round's clients trained at once in this process.

:class:`BatchedGrid` is the in-process :class:`server.local_grid.LocalGrid` with one difference:
the train messages a round sends are answered together. Each client reads its message, its
state and its data as the ClientApp does (:func:`client.app.read_round`); then all of them train
at once with ``torch.func`` (:func:`client.batched_training.train_batched`, on ``sim.device``);
then each compresses, encodes, stores its state and replies as the ClientApp does
(:func:`client.app.reply_round`: its compressor runs on the device, its state goes back to the
host). The server, its strategy and its records are the other engines' own. Other messages
(queries, federated evaluation) run the ClientApp one at a time, as on LocalGrid.

What differs from the local engine is only the order of floating-point sums inside the batched
kernels: the models agree within 1e-5 (tests/test_engines.py). A model the batched trainer
cannot take (the character LSTM; see :mod:`client.batched_training`) is refused before round 1
(:func:`check_batched`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import Message, MessageType

from client import app as client
from client.batched_training import BatchedClient, train_batched, unsupported
from fedgc.settings import RunConfig, SettingsError
from fedgc.task_loader import load_task
from server.local_grid import LocalGrid, error_reply


def check_batched(config: RunConfig) -> None:
    """SettingsError, before round 1, when the run's model cannot be trained batched."""
    task = load_task(config.train.task_spec())
    with torch.random.fork_rng(devices=[]):
        model = task.build_model()
    reason = unsupported(task, model)
    if reason is not None:
        raise SettingsError(f"sim.engine=batched cannot train task {config.train.task!r}: "
                            f"{reason}; use sim.engine=local or ray")


class BatchedGrid(LocalGrid):
    """A LocalGrid that trains the clients of a round at once (module docstring)."""

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the queued messages now; the train messages together."""
        messages = [m for m in (self._inbox.pop(mid, None) for mid in message_ids)
                    if m is not None]
        replies: dict[int, Message | None] = {}
        trainees: list[tuple[int, client.RoundInput]] = []
        for i, msg in enumerate(messages):
            context = self.context_of(msg.metadata.dst_node_id)
            try:
                if msg.metadata.message_type != MessageType.TRAIN:
                    replies[i] = self.client_app(msg, context)
                    continue
                torch.set_num_threads(1)  # as the ClientApp's train: the local engine's sums
                read = client.read_round(msg, context)
            except Exception as ex:  # as LocalGrid: the exception becomes an error reply
                replies[i] = error_reply(msg, ex)
                continue
            if isinstance(read, Message):
                replies[i] = read  # a round it already answered
            else:
                trainees.append((i, read))
        for group in _groups(trainees):
            self._train(group, replies)
        delivered = (self.deliver(replies[i]) for i in range(len(messages)) if i in replies)
        return [r for r in delivered if r is not None]

    def _train(self, group: list[tuple[int, client.RoundInput]],
               replies: dict[int, Message | None]) -> None:
        first = group[0][1]
        s = first.s
        model = client._model(first.task, s.task_spec(), first.device)  # noqa: SLF001
        try:
            results: list = train_batched(
                model, [BatchedClient(r.start, r.train_x, r.train_y, r.seed)
                        for _, r in group],
                lr=s.lr, batch_size=s.batch_size, local_epochs=s.local_epochs,
                local_steps=s.local_steps, momentum=s.client_momentum,
                weight_decay=s.weight_decay)
        except Exception as ex:  # the whole group fails as each client would have
            results = [ex] * len(group)
        # train_locally seeds torch's generator with each client's seed in turn: leave it as
        # the local engine does after the round's last client.
        torch.manual_seed(group[-1][1].seed)
        for (i, r), result in zip(group, results, strict=True):
            try:
                if isinstance(result, BaseException):
                    raise result
                replies[i] = client.reply_round(r, result)
            except Exception as ex:
                replies[i] = error_reply(r.msg, ex)


def _groups(trainees: list[tuple[int, client.RoundInput]],
            ) -> list[list[tuple[int, client.RoundInput]]]:
    """The trainees by what their training shares (a round's messages share everything)."""
    groups: dict[tuple, list[tuple[int, client.RoundInput]]] = {}
    for i, r in trainees:
        s = r.s
        key = (s.task_spec(), s.lr, s.batch_size, s.local_epochs, s.local_steps,
               s.client_momentum, s.weight_decay, r.device)
        groups.setdefault(key, []).append((i, r))
    return list(groups.values())
