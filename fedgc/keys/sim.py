"""The simulation engine's keys (part ``sim``, ``sim.*``): where clients run and on what.

``sim.device`` is sent in every train message (a client trains on it); the others are the
server's (the engine, Ray's resources). Under ``flwr run`` Flower's federation config sets what
these do, so its app config leaves them out (``server.app.flwr_app_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgc.schema import Check, setting

__all__ = ["DEVICES", "ENGINES", "SimDeviceKeys", "SimKeys"]

#: Simulation engines: Flower's Ray backend, every client in this process one after another, or
#: a round's clients trained at once in this process (``torch.func``, MLP and CNN models).
ENGINES = ("ray", "local", "batched")
#: Where clients train and compress (``sim.device``): auto is cuda where torch sees one.
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class SimDeviceKeys:
    """Where a client trains: sent to clients."""

    device: str = setting("cpu", "sim.device", "where clients train and compress: cpu, cuda, or "
                          "auto (cuda where torch sees one); models, batches and the compressor "
                          "on the device, client state on the host; cuda on a machine without "
                          "it stops the run before round 1", Check(choices=DEVICES))


@dataclass(frozen=True)
class SimKeys:
    """The engine and its resources: the server's."""

    engine: str = setting("ray", "sim.engine", "ray: Flower's simulation engine (Ray backend); "
                          "local: server.local_grid.LocalGrid, every client in this process "
                          "one after another (tests, debugging); batched: the same, but a "
                          "round's clients trained at once with torch.func (MLP and CNN "
                          "models; simulations/batched_engine.py), the local engine's models",
                          Check(choices=ENGINES))
    cpus_per_client: float = setting(1.0, "sim.cpus_per_client", "Ray CPUs per ClientApp "
                                     "actor (fractional allowed)", Check(0.0, low_open=True))
    num_cpus: int = setting(0, "sim.num_cpus", "CPUs Ray may use; 0 = all", Check(0))
    gpus_per_client: float = setting(0.0, "sim.gpus_per_client", "Ray GPUs per ClientApp "
                                     "actor (Flower's client_resources.num_gpus; 0.25: four "
                                     "clients share a GPU); 0 = Ray schedules clients by CPU "
                                     "alone", Check(0.0))
    ray_address: str = setting("", "sim.ray_address", "attach to a running Ray cluster "
                               "(HEAD:PORT of `ray start --head`, or auto) instead of starting "
                               "Ray here; its nodes declare their CPUs (sim.num_cpus must stay "
                               "0) and state_dir must be a folder every node mounts "
                               "(docs/cluster.md); empty = a fresh Ray instance on this machine")
