"""Atomic checkpoints of the global model and the strategy state (write tmp + ``os.replace``)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from fedgc.files import atomic_write

CHECKPOINT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing a part, is damaged, or belongs to another model."""


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt``; a crash leaves the previous file intact."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / CHECKPOINT_FILE
    atomic_write(path, lambda fh: torch.save(
        {"checkpoint_version": CHECKPOINT_VERSION, **state}, fh))
    return path


def load_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state saved in ``directory``, or None when there is no checkpoint yet."""
    path = Path(directory) / CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as ex:  # torch raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} is unreadable: {ex}") from ex
    if not isinstance(state, dict) or state.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a version-{CHECKPOINT_VERSION} fedgc "
                              f"checkpoint")
    return state
