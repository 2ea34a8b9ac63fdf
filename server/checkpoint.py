"""Atomic checkpoints of the global model and the strategy state (write tmp + ``os.replace``)."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing a part, is damaged, or belongs to another model."""


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt``; a crash leaves the previous file intact."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / CHECKPOINT_FILE
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"checkpoint_version": CHECKPOINT_VERSION, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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


#: The layout of :meth:`server.strategy.DGCStrategy.state_dict` (older layouts of the same
#: version are upgraded by :func:`migrate_strategy_state`).
STRATEGY_STATE_VERSION = 1


def migrate_strategy_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the current layout; CheckpointError for another strategy state version.

    Older checkpoints kept one ``version`` per client (-1: unknown) instead of ``versions``,
    and past models instead of ``changed_at`` (then every entry counts as changed at the
    checkpoint's version: patches only from then on).
    """
    if state.get("strategy_state_version") != STRATEGY_STATE_VERSION:
        raise CheckpointError(f"strategy state version {state.get('strategy_state_version')}"
                              f" is not {STRATEGY_STATE_VERSION}")
    state = dict(state)
    clients = {}
    for key, info in state["clients"].items():
        if "versions" in info:
            versions = [int(v) for v in info["versions"]]
        else:
            versions = [int(info["version"])] if int(info.get("version", -1)) >= 0 else []
        clients[key] = {"acked": int(info["acked"]), "versions": versions}
    state["clients"] = clients
    if "changed_at" not in state:
        version = int(state["model_version"])
        state["changed_at"] = {k: torch.full(tuple(v.shape), version, dtype=torch.int32)
                               for k, v in state["model"].items()}
    return state
