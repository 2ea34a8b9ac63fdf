"""Wiring of the emulator into a fedgc run: config keys, the wrapped ClientApp, the server's
extensions.

``python -m simulations run --set netem.enabled=true --set netem.mix=lte:0.5,3g:0.5 ...``:
the CLI splits the ``netem.*`` keys off with :func:`split_netem`, and the runner wraps the
ClientApp with :func:`wrap_client_app` and gives the strategy the emulator's
:func:`extensions` (:mod:`server.extensions`), like any other extension.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedgc import protocol as P
from fedgc.settings import RunConfig
from fedgc.task_loader import load_task
from server.extensions import RoundExtension
from simulations.netem.compute import model_compute_scale
from simulations.netem.extension import NetemClock
from simulations.netem.mod import netem_mod
from simulations.netem.settings import PREFIX, NetemSettings
from simulations.netem.wire_columns import WireColumns


def split_netem(values: Mapping[str, object]) -> tuple[dict[str, object], NetemSettings]:
    """(the other keys, NetemSettings of the ``netem.*`` keys)."""
    rest = {k: v for k, v in values.items() if not k.startswith(PREFIX)}
    netem = NetemSettings.from_config({k: v for k, v in values.items() if k.startswith(PREFIX)})
    return rest, netem


def for_run(netem: NetemSettings, config: RunConfig) -> NetemSettings:
    """``netem`` with the client count and per-round samples taken from a RunConfig, the
    compute scale derived from the run's model when it is 0
    (:func:`simulations.netem.compute.model_compute_scale`), and the trace, power-model and
    protocol-profile files as absolute paths (clients may run in another folder)."""
    t = config.train
    scale = netem.compute_scale
    if netem.enabled and scale == 0:
        scale, _ = model_compute_scale(load_task(t.task_spec()))
    samples = t.local_steps * t.batch_size if t.local_steps > 0 else 0
    traces = {k: os.path.abspath(getattr(netem, k))
              for k in ("trace_down", "trace_up", "power_model") if getattr(netem, k)}
    if netem.profile_file():
        traces["protocol"] = netem.profile_file()
    return dataclasses.replace(netem, num_clients=t.num_clients,
                               local_epochs=float(t.local_epochs), local_samples=samples,
                               compute_scale=scale, **traces)


def wrap_client_app(app: ClientApp) -> ClientApp:
    """A ClientApp that runs ``app`` behind :func:`~simulations.netem.mod.netem_mod`."""
    wrapped = ClientApp(mods=[netem_mod])

    def forward(msg: Message, context: Context) -> Message:
        return app(msg, context)

    wrapped.train()(forward)
    wrapped.evaluate()(forward)
    wrapped.query()(forward)
    wrapped.query(P.SECAGG_ACTION)(forward)  # secure aggregation's stages (client/secure.py)
    return wrapped


def extensions(netem: NetemSettings, config: RunConfig) -> list[RoundExtension]:
    """The emulator's server extensions for a run of ``config`` (``netem`` from
    :func:`for_run`): its round clock, then its wire and energy columns (which read the
    clock's ``virtual_seconds``)."""
    clock = NetemClock(netem, config.train.clients_per_round, config.server.over_selection)
    return [clock, WireColumns(netem, clock)]
