"""Run one scenario on Flower's simulation engine (Ray backend) and return its summary.

The engine is started with ``flwr.simulation.run_simulation._run_simulation``: the function
that Flower 1.42's own simulation runtime (``flwr-simulation``, what ``flwr run`` starts)
calls to run the Ray backend, and that the deprecated ``run_simulation`` wraps. Flower 1.42 has
no public, supported way to run the Ray backend in this process: ``flwr.simulation`` exports
``run_simulation`` (deprecated), ``start_simulation`` (the legacy API) and
``run_simulation_process`` (which pulls its run from a SuperLink). ``flwr run`` goes through a
SuperLink and a ``flwr-simulation`` subprocess that load the apps by name, so this process's
objects (the network emulator's wrapped ClientApp and strategy, the validated RunConfig) cannot
travel, and its federation config has no Ray address (``sim.ray_address``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

import client.app
from fedgc.flower_log import flower_logging, mute_threads
from fedgc.settings import RunConfig, SettingsError
from fedgc.task_loader import ALLOWED_CALLABLES
from server.app import NothingAggregatedError, RunFolderError, prepare_run_dir, run_server
from server.checkpoint import CheckpointError
from server.local_grid import LocalGrid
from server.preflight import PreflightError
from server.registry import NoClientsError
from simulations import cluster
from simulations.batched_engine import BatchedGrid, check_batched
from simulations.interrupt import GridStopped, RunInterrupted, StoppableGrid, last_kept_round
from simulations.netem.integration import extensions, for_run, wrap_client_app
from simulations.netem.settings import NetemSettings

#: What a run reports as a message rather than a traceback (``simulations.cli`` prints them).
RUN_ERRORS = (NothingAggregatedError, RunFolderError, CheckpointError, PreflightError,
              NoClientsError)
#: Seconds a Ctrl-C waits for the ServerApp thread to leave its round (it polls every 0.1 s;
#: an evaluation or a checkpoint under way finishes first).
STOP_WAIT_S = 5.0


def backend_config(config: RunConfig) -> dict[str, Any]:
    """The Ray backend config: CPUs per ClientApp actor, and where Ray runs.

    Without ``sim.ray_address`` a fresh Ray instance on this machine with ``sim.num_cpus``
    (``address="local"``: never a cluster someone started here with ``ray start``); with it,
    that cluster, whose nodes declare their own CPUs.
    """
    s = config.server
    if s.ray_address:
        if s.num_cpus:
            raise SettingsError(f"sim.num_cpus = {s.num_cpus} cannot be used with "
                                f"sim.ray_address = {s.ray_address!r}: the cluster's nodes "
                                f"declare their CPUs (ray start --num-cpus); leave it 0")
        init_args = cluster.init_args(s.ray_address)
    else:
        init_args = {"address": "local", "num_cpus": s.num_cpus or os.cpu_count() or 1,
                     "include_dashboard": False}
    return {"client_resources": {"num_cpus": s.cpus_per_client, "num_gpus": s.gpus_per_client},
            "init_args": init_args}


def ray_environment() -> None:
    """Ray's settings for a simulation, unless the user set them: one copy of a line that many
    actors print, and no FutureWarning about GPU variables (an actor that asks for no GPU
    keeps seeing the machine's, so ``sim.device=cuda`` works with ``sim.gpus_per_client=0``)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def run_engine(server_app: ServerApp, client_app: ClientApp, num_supernodes: int,
               backend: dict[str, Any], verbose: bool = False) -> None:
    """Run ``server_app`` against ``num_supernodes`` simulated SuperNodes of ``client_app`` on
    Flower's simulation engine (Ray backend), in this process, with Flower's log configured by
    :func:`fedgc.flower_log.flower_logging` (see the module docstring for the function used).

    ``backend``: Flower's backend config (:func:`backend_config`).
    """
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    ray_environment()
    with flower_logging(verbose):
        _run_simulation(num_supernodes=num_supernodes, client_app=client_app,
                        server_app=server_app, backend_name="ray",
                        backend_config=backend, verbose_logging=verbose,
                        exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE)


def run_scenario(config: RunConfig, verbose: bool = False,
                 netem: NetemSettings | None = None) -> dict[str, Any]:
    """Run ``config`` with ``num_clients`` simulated SuperNodes; write and return the summary.

    With ``netem.enabled`` the rounds run on the network emulator's virtual clock. Ctrl-C
    (KeyboardInterrupt) stops the run on either engine within seconds and raises
    :class:`simulations.interrupt.RunInterrupted`, which names the round kept.
    """
    try:
        return _run_scenario(config, verbose, netem)
    except KeyboardInterrupt:
        raise RunInterrupted(config.run_dir, last_kept_round(config.run_dir),
                             config.server.rounds, config.server.checkpoint) from None


def check_engine(config: RunConfig, netem: NetemSettings | None) -> None:
    """SettingsError for a run its engine cannot run (``sim.engine=batched`` and the emulator,
    or a method or task the batched engine lacks); nothing is created."""
    if config.server.engine == "batched":
        if netem is not None and netem.enabled:
            raise SettingsError("sim.engine=batched does not run the network emulator (its "
                                "mod charges each client's messages one at a time); use "
                                "sim.engine=local or ray with netem.enabled")
        check_batched(config)


def _run_scenario(config: RunConfig, verbose: bool,
                  netem: NetemSettings | None) -> dict[str, Any]:
    check_engine(config, netem)
    # Fail before Ray starts when the folder is taken; run_server takes its lock again.
    prepare_run_dir(config).release()
    extra: dict[str, Any] = {}
    client_app: ClientApp = client.app.app  # read when the run starts (tests replace it)
    if netem is not None and netem.enabled:
        derived = netem.compute_scale == 0
        netem = for_run(netem, config)
        if config.server.progress:
            how = "derived from the model's multiply-adds" if derived else "netem.compute_scale"
            print(f"fedgc: emulated compute: the device presets' x {netem.compute_factor:.3g} "
                  f"({how})", flush=True)
        client_app = wrap_client_app(client_app)
        extra["extensions"] = extensions(netem, config)
    # Simulated nodes run the simulating user's own config: any callable it names (a deployed
    # node runs only those its node config lists, client.app.allowed_callables).
    simulated = {ALLOWED_CALLABLES: "*"}
    if config.server.engine == "batched":
        with flower_logging(verbose):
            return run_server(BatchedGrid(client_app, config.train.num_clients,
                                          seed=config.train.seed, node_config=simulated),
                              config, **extra)
    if config.server.engine == "local":
        with flower_logging(verbose):
            return run_server(LocalGrid(client_app, config.train.num_clients,
                                        seed=config.train.seed, node_config=simulated),
                              config, **extra)
    ray_environment()  # before cluster.attach starts Ray
    backend = backend_config(config)  # a SettingsError before anything starts
    if config.server.ray_address:
        # Connected here, Flower's backend finds Ray initialised and keeps this connection.
        nodes = cluster.attach(config.server.ray_address, config.state_dir.resolve())
        if config.server.progress:
            print(f"Ray cluster at {config.server.ray_address}: {cluster.describe(nodes)}",
                  flush=True)

    outcome: dict[str, Any] = {}
    server_app = ServerApp()
    stop, server_done = threading.Event(), threading.Event()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        del context  # the scenario's RunConfig replaces the (empty) simulation run config
        try:
            outcome["summary"] = run_server(StoppableGrid(grid, stop), config, **extra)
        except RUN_ERRORS as ex:
            outcome["error"] = ex  # raised again below, to the caller: a message, no traceback
        except GridStopped:
            pass  # Ctrl-C: the main thread reports it
        finally:
            server_done.set()

    before = set(threading.enumerate())
    try:
        run_engine(server_app, client_app, config.train.num_clients, backend, verbose)
    except KeyboardInterrupt:
        # Flower has stopped its runtime; the ServerApp thread still waits for replies, and
        # the runtime's workers on busy actors wait for them until Ray shuts down, then log
        # the ActorDiedError with a traceback: the interrupt's echo, muted (the threads the
        # runtime started are those that were not there before it).
        muted = mute_threads(t for t in threading.enumerate() if t not in before)
        stop.set()
        server_done.wait(STOP_WAIT_S)
        _shutdown_ray(config)
        muted.release()
        raise
    finally:
        if config.server.ray_address:
            cluster.detach()
    if "error" in outcome:
        raise outcome["error"]
    if "summary" not in outcome:
        raise RuntimeError(f"the simulation of {config.run_dir} ended without a summary; see "
                           f"the log above")
    return outcome["summary"]


def _shutdown_ray(config: RunConfig) -> None:
    """Stop the Ray instance this run started, if a Ctrl-C came before Flower's runtime could
    (while Ray was starting); a cluster (``sim.ray_address``) is only detached from."""
    if config.server.ray_address:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
