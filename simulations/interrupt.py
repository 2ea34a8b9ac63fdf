"""Ctrl-C: stop a run within seconds on either engine, keep its last checkpoint, say so once.

On the in-process engine (``sim.engine=local``) Python's KeyboardInterrupt lands in the round
itself, and every file a round writes (checkpoint, results, client records) is replaced
atomically, so the files hold the last finished round. On Flower's Ray engine it lands in the
main thread, which runs Flower's simulation runtime, while the ServerApp runs in a thread of
its own: Flower stops its runtime and Ray, but the ServerApp thread would go on waiting for
replies that never come, for ``round_timeout_s``, and keep the process alive. The ServerApp
therefore talks to Flower through a :class:`StoppableGrid`, which :func:`simulations.runner.
run_scenario` stops on KeyboardInterrupt: the ServerApp thread leaves its round at once, the
round unfinished and unrecorded, as on the in-process engine.

:class:`RunInterrupted` says where the run stopped and what it kept; the command line prints
it as one line (exit status 130, the shell's for SIGINT).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from server.checkpoint import CHECKPOINT_FILE

#: Seconds between two looks for replies (Flower's InMemoryGrid polls every 0.1 s as well).
POLL_S = 0.1


class GridStopped(RuntimeError):
    """The run was stopped (Ctrl-C) while the ServerApp waited on the grid."""


class StoppableGrid(Grid):
    """``grid`` with a stop switch: once ``stop`` is set, every call raises GridStopped, and
    so does a :meth:`send_and_receive` waiting for replies (within :data:`POLL_S`).

    Replies are collected as Flower's own ``send_and_receive`` does (push, then pull until all
    replies are in or ``timeout`` passes); a stopped wait returns no partial round.
    """

    def __init__(self, grid: Grid, stop: threading.Event) -> None:
        self.grid = grid
        self.stop = stop

    def _check(self) -> None:
        if self.stop.is_set():
            raise GridStopped("the run was interrupted")

    def set_run(self, run) -> None:  # noqa: ANN001 - Flower's Run
        """Flower's ``Grid.set_run``."""
        self.grid.set_run(run)

    @property
    def run(self):  # noqa: ANN201 - Flower's Run
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """Flower's (deprecated) ``Grid.create_message``."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's node ids (GridStopped once stopped)."""
        self._check()
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push to the wrapped grid (GridStopped once stopped)."""
        self._check()
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull from the wrapped grid (GridStopped once stopped)."""
        self._check()
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then pull until every reply is in, ``timeout`` seconds pass
        (None: no limit), or the run is stopped (GridStopped)."""
        waiting = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            if self.stop.wait(POLL_S):
                self._check()
        return replies


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT): where it stopped and what it kept.

    A KeyboardInterrupt still, so that no ``except Exception`` swallows it (a notebook's
    interrupt stays one). ``last_round``: the last round whose results (and checkpoint, with
    ``checkpoint``) were kept, 0 when none finished; ``rounds``: the rounds asked for.
    """

    def __init__(self, run_dir: Path, last_round: int, rounds: int, checkpoint: bool) -> None:
        super().__init__(run_dir, last_round, rounds, checkpoint)  # args: it pickles whole
        self.run_dir, self.last_round = Path(run_dir), last_round
        self.rounds, self.checkpoint = rounds, checkpoint

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """Where the run stopped and what it kept, in one sentence."""
        stopped = (f"interrupted in round {self.last_round + 1} of {self.rounds} ({self.run_dir})"
                   if self.last_round < self.rounds else f"interrupted after its last round "
                   f"({self.run_dir})")
        if self.last_round == 0:
            return f"{stopped}: no round had finished, nothing to resume"
        if not self.checkpoint:
            return f"{stopped}: rounds.csv holds rounds 1-{self.last_round}; no checkpoint " \
                   f"(checkpoint=false), so it cannot be resumed"
        return f"{stopped}: {CHECKPOINT_FILE} holds round {self.last_round}"


def last_kept_round(run_dir: Path) -> int:
    """The last round in ``run_dir``'s ``rounds.csv`` (written after the round's checkpoint),
    0 without one."""
    path = Path(run_dir) / "rounds.csv"
    try:
        lines = [ln for ln in path.read_text().splitlines()[1:] if ln.strip()]
    except (OSError, UnicodeDecodeError):
        return 0
    try:
        return int(float(lines[-1].split(",", 1)[0])) if lines else 0
    except ValueError:
        return len(lines)
