"""The run's keys by owner: one schema class per owner, none of which imports a method.

Each part of fedgc declares its keys in its own module, on the settings engine
(:mod:`fedgc.schema`): the run (:mod:`fedgc.keys.run`), the client (``client``), the server
(``server``), the simulation engine (``sim``), the attack (``attack``); a compression method
declares its own with its method (:attr:`fedgc.methods.Method.settings`), the network emulator
its ``netem.*`` keys (``simulations.netem.settings``). :mod:`fedgc.keys.sides` composes the
owners into what travels to clients (:class:`TrainSettings`) and what the server keeps
(:class:`ServerSettings`). Nothing here imports the method registry, so the methods' hooks are
typed with these classes; :mod:`fedgc.settings` combines them with the methods' keys.

Where a new key goes: one a client reads for its local round, ``client``; one the server reads,
``server``; what the run is and where it goes, ``run``; the engine's, ``sim``; a hostile
client's, ``attack``; a method's, its method's settings (``sent=False`` for a key only its
server half reads); the emulator's, ``simulations/netem/settings.py``.
"""

from fedgc.keys.sides import FlatValue, RunSettings, ServerSettings, TrainSettings

__all__ = ["FlatValue", "RunSettings", "ServerSettings", "TrainSettings"]
