"""Checks before the first round: a run that cannot work fails at once, with one clear message.

Without them such a run started, every client failed every round, and the run ended as if it
had succeeded. :func:`check_run` is called by :func:`server.app.prepare_run_dir`, so that
``python -m simulations run`` refuses before Ray starts and ``flwr run`` before round 1; it
creates nothing (the folders are :mod:`server.folders`' once every check has passed).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from fedgc.devices import DeviceError, resolve
from fedgc.task_loader import load_task
from server.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint
from tasks.errors import DataError


class PreflightError(ValueError):
    """The run cannot work as configured (it names the setting or path and the problem)."""


def check_run(config: Any) -> None:
    """Refuse a run that cannot work: clients without data, a resume without a checkpoint or
    with one that cannot be read, TensorBoard asked for but missing. Nothing is created or
    written.

    Raises
    ------
    PreflightError
        Naming the setting or path and the problem.
    """
    check_device(config)
    check_partitions(config)
    if config.server.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise PreflightError("tensorboard=true needs the tensorboard package: `pip install -e "
                             "'.[tensorboard]'` in the fedgc checkout (or tensorboard==2.21.0)")
    if config.server.resume:
        # Here, before any folder is made: a refused resume creates nothing (issue 35).
        if not config.server.checkpoint:
            raise PreflightError("resume=true needs checkpoints (checkpoint=true): there is "
                                 "nothing to resume from")
        if not (config.run_dir / CHECKPOINT_FILE).exists():
            raise PreflightError(f"resume=true, but {config.run_dir} holds no "
                                 f"{CHECKPOINT_FILE}; run without resume to start a new run")
        try:
            load_checkpoint(config.run_dir)
        except CheckpointError as ex:
            raise PreflightError(f"resume=true: {ex}") from ex


def check_device(config: Any) -> None:
    """``sim.device`` is a device this machine has, and Ray is not asked for GPUs it lacks
    (its actors would wait for them for ever)."""
    import torch

    try:
        resolve(config.train.device)
    except DeviceError as ex:
        raise PreflightError(str(ex)) from ex
    s = config.server
    if s.engine == "ray" and s.gpus_per_client > 0 and not s.ray_address \
            and not torch.cuda.is_available():
        raise PreflightError(f"sim.gpus_per_client = {s.gpus_per_client} but torch sees no "
                             f"CUDA device on this machine: Ray would never start a client; "
                             f"use 0, or a Ray cluster with GPUs (sim.ray_address)")


def check_partitions(config: Any) -> None:
    """Every client gets a partition of at least one sample (what the clients compute).

    Loading the task here also makes a task of the user's own fail before round 1, with the
    :class:`fedgc.settings.SettingsError` that names it.
    """
    t = config.train
    try:
        task = load_task(t.task_spec())
    except DataError as ex:
        raise PreflightError(f"task {t.task!r}: {ex}") from ex
    if task.client_data is not None:
        # Made per client on demand: check the first and the last, without a million calls.
        for key in sorted({0, t.num_clients - 1}):
            try:
                x, _ = task.data_of(key, t.num_clients)
            except DataError as ex:
                raise PreflightError(f"task {t.task!r}: {ex}") from ex
            if len(x) == 0:
                raise PreflightError(f"task {t.task!r}: client_data({key}) holds no sample")
        return
    try:
        parts = task.partition(t.num_clients, scheme=t.partition, alpha=t.alpha, seed=t.seed)
    except DataError as ex:
        raise PreflightError(f"num_clients={t.num_clients}, task {t.task!r}, partition "
                             f"{t.partition!r}: {ex}") from ex
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise PreflightError(f"num_clients={t.num_clients}, task {t.task!r}, partition "
                             f"{t.partition!r}: clients {empty[:5]} would get no sample")


def check_writable(folder: Path, setting: str, why: str) -> None:
    """Create ``folder`` if missing and write a file in it, or raise naming ``setting``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fedgc-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as ex:
        raise PreflightError(f"{setting} {folder} is not a writable folder "
                             f"({ex.strerror or ex}); {why}") from ex
