"""fedgc's public Python API, and the shared layer below client, server and the bridge.

The API (``import fedgc``)::

    result = fedgc.run(task="digits", rounds=5, sim__engine="local")    # one run
    both = fedgc.compare(task="digits", rounds=5, methods=["dense", "dgc"])
    fedgc.results(both.folder)                                          # read back later

``run``, ``compare`` and ``results`` are :mod:`simulations.api`'s (the command line's own code
path: keys, scenarios, results folders, errors), resolved on first use, so that ``import
fedgc`` stays light and the shared layer imports nothing of the simulations above it.

The shared layer: the message contract (:mod:`fedgc.protocol`), the settings engine and run
keys (:mod:`fedgc.schema`, :mod:`fedgc.settings`), the method plugins and their catalogue
(:mod:`fedgc.methods`), secure aggregation and differential privacy (:mod:`fedgc.privacy`),
local training (:mod:`fedgc.training`), task loading, files and logs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompareResult", "RunResult", "compare", "results", "run"]


def __getattr__(name: str) -> Any:
    """``fedgc.run`` and the rest of ``__all__``, from :mod:`simulations.api` on first use."""
    if name not in __all__:
        raise AttributeError(f"module 'fedgc' has no attribute {name!r}")
    # Imported here: start-up; `import fedgc` loads neither torch nor the simulations.
    from simulations import api

    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
