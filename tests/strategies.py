"""Strategies for the tests: DGCStrategy of a few run keys over the settings these tests fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedgc.settings import RunConfig
from server.strategy import DGCStrategy

#: What the strategy tests take as given unless they say otherwise: no checkpoints, the exact
#: model on the downlink (float16 when compressed, one version of history), no sign channel,
#: no server momentum, DGCConfig's layer policy, clients that do not build version 0.
FIXED = {"checkpoint": False, "downlink_density": 1.0, "downlink_values": "float16",
         "downlink_history": 1, "clients_build_initial_model": False,
         "dgc.shared_density": 0.0, "server_momentum": 0.0, "dgc.min_sparse_numel": 1024,
         "dgc.sparse_vectors": False}


def config_of(checkpoint_dir: str | Path | None = None, **keys: Any) -> RunConfig:
    """The RunConfig of ``keys`` (``__`` for a key's dot) over :data:`FIXED`; with
    ``checkpoint_dir`` the run folder is that folder and checkpoints are on."""
    values: dict[str, Any] = {**FIXED, **{k.replace("__", "."): v for k, v in keys.items()}}
    values.setdefault("num_clients", max(100, int(values.get("clients_per_round", 10))))
    if checkpoint_dir is not None:
        folder = Path(checkpoint_dir)
        values.update(checkpoint=True, results_dir=str(folder.parent), run_name=folder.name)
    else:
        values.setdefault("run_name", "strategy-test")
    return RunConfig.from_flat(values)


def make_strategy(checkpoint_dir: str | Path | None = None, on_round: Any = None,
                  **keys: Any) -> DGCStrategy:
    """A DGCStrategy of :func:`config_of` (``on_round`` passed through)."""
    return DGCStrategy(config_of(checkpoint_dir, **keys), on_round=on_round)
