"""Secure aggregation for compressed updates: SecAgg+ over an integer vector every client knows
the coordinates of, as a server session and a client handler that exchange bytes per stage.

:class:`ServerSession` (``server.py``) and :class:`ClientHandler` (``client.py``) run the
protocol; ``wire.py`` is its messages, ``crypto.py`` the library primitives it uses, ``graph.py``
the neighbour graph, ``cost.py`` the bytes per client per stage. ``docs/privacy.md`` walks
through it.
"""

from fedgc.privacy.secagg.client import ClientHandler
from fedgc.privacy.secagg.cost import ROUND_TRIPS, STAGES, StageBytes, client_bytes
from fedgc.privacy.secagg.errors import BadMessage, SecAggError, StageError, ThresholdError
from fedgc.privacy.secagg.graph import default_neighbours, default_threshold
from fedgc.privacy.secagg.server import ServerSession

__all__ = ["ROUND_TRIPS", "STAGES", "BadMessage", "ClientHandler", "SecAggError",
           "ServerSession", "StageBytes", "StageError", "ThresholdError", "client_bytes",
           "default_neighbours", "default_threshold"]
