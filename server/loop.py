"""The round loop: Flower's ``Strategy.start`` with resume from a checkpoint and a checkpoint
after every round (Flower 1.42's loop always starts at round 1 and has no hook after a round)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from server.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint
from server.records import RoundRecord
from server.registry import NoClientsError


class RoundStrategy(Protocol):
    """What the loop asks of a strategy (:class:`server.strategy.DGCStrategy` is one)."""

    resume: bool
    checkpoint_dir: Path | None
    completed_rounds: int
    round_record: RoundRecord
    rounds: list[RoundRecord]
    fraction_evaluate: float

    def summary(self) -> None: ...
    def set_model(self, arrays: ArrayRecord) -> None: ...
    def load_state_dict(self, state: Any) -> None: ...
    def model_arrays(self) -> ArrayRecord: ...
    def keep_round(self, record: RoundRecord) -> None: ...
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]: ...
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]: ...
    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None: ...


def resume_from_checkpoint(strategy: RoundStrategy) -> None:
    """With ``resume = true``, continue ``strategy`` from its checkpoint (the synchronous and
    the asynchronous loop alike); refused with CheckpointError when there is none."""
    if not strategy.resume:
        return
    # A resume that found nothing would run from round 1 over the clients' old residuals.
    if strategy.checkpoint_dir is None:
        raise CheckpointError("resume=true needs checkpoints (checkpoint=true): there is "
                              "nothing to resume from")
    saved = load_checkpoint(strategy.checkpoint_dir)
    if saved is None:
        raise CheckpointError(f"resume=true, but {strategy.checkpoint_dir} holds no "
                              f"{CHECKPOINT_FILE}; run without resume to start a new run")
    if saved.get("run_config") is None:
        log(WARNING, "The checkpoint in %s stores no run configuration (an earlier fedgc): "
            "resuming without checking it", strategy.checkpoint_dir)
    strategy.load_state_dict(saved)
    log(INFO, "Resumed from %s after round %d", strategy.checkpoint_dir,
        strategy.completed_rounds)


def run_rounds(strategy: RoundStrategy, grid: Grid, initial_arrays: ArrayRecord,
               num_rounds: int = 3, timeout: float = 3600,
               train_config: ConfigRecord | None = None,
               evaluate_config: ConfigRecord | None = None,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
               ) -> Result:
    """Run ``strategy``'s rounds ``completed_rounds + 1 .. num_rounds`` on ``grid``.

    As Flower's loop: train, federated evaluation (with ``fraction_evaluate > 0``), centralized
    evaluation (``evaluate_fn``, whose ``accuracy`` and ``loss`` fill the round's record). Each
    finished round goes to the strategy's ``keep_round`` (records, checkpoint, ``on_round``).
    """
    log(INFO, "Starting %s strategy:", strategy.__class__.__name__)
    strategy.summary()
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    strategy.set_model(initial_arrays)
    resume_from_checkpoint(strategy)
    result = Result()
    for r in strategy.rounds:
        result.evaluate_metrics_serverapp[r.round] = MetricRecord(
            {"accuracy": r.accuracy, "loss": r.loss})
    if evaluate_fn and strategy.completed_rounds == 0:
        res = evaluate_fn(0, strategy.model_arrays())
        if res is not None:
            result.evaluate_metrics_serverapp[0] = res
    for current_round in range(strategy.completed_rounds + 1, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
        started = time.time()
        messages = list(strategy.configure_train(current_round, strategy.model_arrays(),
                                                 train_config, grid))
        if not messages:
            # Counted as done, an empty round would end a resumed run "successfully".
            raise NoClientsError(f"round {current_round} sampled no client; a round without "
                                 f"clients is not run")
        replies = grid.send_and_receive(messages=messages, timeout=timeout)
        _, train_metrics = strategy.aggregate_train(current_round, replies)
        if train_metrics is not None:
            result.train_metrics_clientapp[current_round] = train_metrics
        if strategy.fraction_evaluate > 0:
            eval_replies = grid.send_and_receive(
                messages=strategy.configure_evaluate(current_round, strategy.model_arrays(),
                                                     evaluate_config, grid), timeout=timeout)
            agg = strategy.aggregate_evaluate(current_round, eval_replies)
            if agg is not None:
                result.evaluate_metrics_clientapp[current_round] = agg
        record = strategy.round_record
        if evaluate_fn:
            res = evaluate_fn(current_round, strategy.model_arrays())
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
                record.accuracy = float(res.get("accuracy", float("nan")))  # type: ignore
                record.loss = float(res.get("loss", float("nan")))  # type: ignore
        record.wall_seconds = time.time() - started
        strategy.keep_round(record)
    result.arrays = strategy.model_arrays()
    return result
