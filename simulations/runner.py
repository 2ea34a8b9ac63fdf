"""Run one scenario on Flower's simulation engine (Ray backend) and return its summary."""

from __future__ import annotations

import logging
import os
from typing import Any

from fedgc.settings import RunConfig
from server.app import NothingAggregatedError, RunFolderError
from server.checkpoint import CheckpointError
from server.preflight import PreflightError
from simulations.netem.settings import NetemSettings

#: What a run reports as a message rather than a traceback (``simulations.cli`` prints them).
RUN_ERRORS = (NothingAggregatedError, RunFolderError, CheckpointError, PreflightError)


def backend_config(config: RunConfig) -> dict[str, Any]:
    """The Ray backend config: CPUs per ClientApp actor and for the whole Ray instance."""
    s = config.server
    init_args: dict[str, Any] = {"num_cpus": s.num_cpus or os.cpu_count() or 1,
                                 "include_dashboard": False}
    return {"client_resources": {"num_cpus": s.cpus_per_client, "num_gpus": 0.0},
            "init_args": init_args}


def run_scenario(config: RunConfig, verbose: bool = False,
                 netem: NetemSettings | None = None) -> dict[str, Any]:
    """Run ``config`` with ``num_clients`` simulated SuperNodes; write and return the summary.

    With ``netem.enabled`` the rounds run on the network emulator's virtual clock.
    """
    # Imported here so that `python -m simulations --help` stays fast.
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from client.app import app as client_app
    from server.app import prepare_run_dir, run_server

    prepare_run_dir(config)  # fail before Ray starts when the folder is taken
    extra: dict[str, Any] = {}
    if netem is not None and netem.enabled:
        from simulations.netem.integration import for_run, strategy_factory, wrap_client_app

        netem = for_run(netem, config)
        client_app = wrap_client_app(client_app)
        extra["strategy_factory"] = strategy_factory(netem)
    if config.server.engine == "local":
        from server.local_grid import LocalGrid

        if not verbose:
            logging.getLogger("flwr").setLevel(logging.WARNING)
        return run_server(LocalGrid(client_app, config.train.num_clients, seed=config.train.seed),
                          config, **extra)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)

    outcome: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        del context  # the scenario's RunConfig replaces the (empty) simulation run config
        try:
            outcome["summary"] = run_server(grid, config, **extra)
        except RUN_ERRORS as ex:
            outcome["error"] = ex  # raised again below, to the caller: a message, no traceback

    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=config.train.num_clients,
                   backend_config=backend_config(config), verbose_logging=verbose)
    if "error" in outcome:
        raise outcome["error"]
    if "summary" not in outcome:
        raise RuntimeError(f"the simulation of {config.run_dir} ended without a summary; see "
                           f"the log above")
    return outcome["summary"]
