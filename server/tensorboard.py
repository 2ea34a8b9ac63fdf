"""TensorBoard scalars of a run's rounds (``tensorboard=true``): one event file per process.

Researchers compare runs in TensorBoard: ``tensorboard --logdir results`` shows every run
folder's ``tensorboard/`` side by side, named by its run folder. Each finished round is written
as scalars at step = round, from the same :class:`server.records.RoundRecord` that
``rounds.csv`` holds, in four groups: ``eval/`` (test accuracy and loss, mean train loss),
``traffic/`` (MB per round both ways and their total, the cumulative total, the uplink's
compression against dense fp32), ``clients/`` (sampled, aggregated, failed, rejected, surplus)
and ``time/`` (wall seconds), and the tags of the extensions' columns
(:class:`server.extensions.Column`: the emulator's virtual seconds and drops). The package is
optional (``pip install -e '.[tensorboard]'`` in the checkout); without it a run that asks for
it is refused before round 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from server.extensions import Column
from server.preflight import PreflightError
from server.records import RoundRecord

__all__ = ["EVENTS_DIR", "RoundWriter", "scalars"]

#: The folder of the event files inside a run folder.
EVENTS_DIR = "tensorboard"
#: The prefix of TensorBoard's event files (what ``overwrite=true`` may delete).
EVENT_FILE_PREFIX = "events.out.tfevents."


def scalars(record: RoundRecord, earlier: Sequence[RoundRecord] = (),
            columns: Sequence[Column] = ()) -> dict[str, float]:
    """The tags and values of one round; ``earlier``: the rounds before it (for the cumulative
    total); ``columns``: the extensions' columns, written under their tags. Values that are not
    finite (no evaluation yet, no train loss) are left out."""
    total_mb = (record.uplink_bytes + record.downlink_bytes) / 1e6
    out = {
        "eval/accuracy": record.accuracy,
        "eval/loss": record.loss,
        "eval/train_loss": record.train_loss,
        "traffic/uplink_MB": record.uplink_bytes / 1e6,
        "traffic/downlink_MB": record.downlink_bytes / 1e6,
        "traffic/total_MB": total_mb,
        "traffic/cumulative_total_MB": total_mb + sum(
            r.uplink_bytes + r.downlink_bytes for r in earlier) / 1e6,
        "traffic/uplink_compression": (record.dense_uplink_bytes / record.uplink_bytes
                                       if record.uplink_bytes else math.nan),
        "clients/sampled": record.clients_sampled,
        "clients/aggregated": record.clients_aggregated,
        "clients/failed": record.clients_failed,
        "clients/rejected": record.clients_rejected,
        "clients/surplus": record.clients_surplus,
        "time/wall_seconds": record.wall_seconds,
    }
    out.update({c.tag: record.extra[c.name] for c in columns
                if c.tag and c.name in record.extra})
    return {tag: float(v) for tag, v in out.items() if math.isfinite(v)}


class RoundWriter:
    """Writes each round's :func:`scalars` to ``<run_dir>/tensorboard/`` and flushes, so that
    a TensorBoard open on the run follows it round by round.

    Raises
    ------
    server.preflight.PreflightError
        The ``tensorboard`` package is not installed (named, with the install command).
    """

    def __init__(self, run_dir: Path, columns: Sequence[Column] = ()) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as ex:
            raise PreflightError("tensorboard=true needs the tensorboard package: `pip install -e "
                                 "'.[tensorboard]'` in the fedgc checkout (or "
                                 "tensorboard==2.21.0)") from ex
        self.log_dir = Path(run_dir) / EVENTS_DIR
        self.columns = list(columns)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, record: RoundRecord, earlier: Sequence[RoundRecord] = ()) -> None:
        """Write round ``record.round`` (``earlier``: the rounds before it) and flush."""
        for tag, value in scalars(record, earlier, self.columns).items():
            self._writer.add_scalar(tag, value, global_step=record.round)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def clear_events(run_dir: Path) -> None:
    """Delete the event files of a replaced run (``overwrite=true``), nothing else."""
    folder = Path(run_dir) / EVENTS_DIR
    if folder.is_dir():
        for f in folder.iterdir():
            if f.is_file() and f.name.startswith(EVENT_FILE_PREFIX):
                f.unlink()
