"""LocalGrid: a Flower Grid that runs a ClientApp in this process, one node after another.

For tests and debugging: the messages are the real Flower Messages and the ClientApp is the real
one, but there is no Ray, no threads and no start-up cost, so a round is deterministic and fast.
Every message is deep-copied on the way in and out, as a transport would, so that neither side
can see the other's objects. Flower's simulation engine (Ray backend,
:func:`simulations.runner.run_engine`) remains what ``python -m simulations`` uses by default.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

#: Error code Flower uses for an exception raised inside a ClientApp.
CLIENT_APP_RAISED_EXCEPTION = 2


_MASK63 = (1 << 63) - 1
_MIX = (0x5DEECE66D2B7E151, 0x27D4EB2F165667C5)  # odd: invertible modulo 2**63
_UNMIX = tuple(pow(c, -1, 1 << 63) for c in _MIX)
_PID_BITS = 39  # partition ids below 2**39 (5.5e11); the seed takes the bits above


def _unshift(x: int, s: int) -> int:
    """The inverse of ``x ^= x >> s`` on 63 bits."""
    out, shift = x, s
    while shift < 63:
        out ^= x >> shift
        shift += s
    return out


def node_id(partition: int, seed: int) -> int:
    """The node id of ``partition``: a bijection of (seed, partition) onto random-looking
    nonzero 63-bit ids, so that ids need no table (a million nodes cost nothing held)."""
    x = ((seed & 0xFFFFFF) << _PID_BITS) | (partition + 1)
    x = (x * _MIX[0]) & _MASK63
    x ^= x >> 31
    x = (x * _MIX[1]) & _MASK63
    return x ^ (x >> 29)


def partition_of_node(node: int, seed: int) -> int | None:
    """The partition whose :func:`node_id` is ``node`` for ``seed``, else None."""
    if not 0 < node <= _MASK63:
        return None
    x = (_unshift(node, 29) * _UNMIX[1]) & _MASK63
    x = (_unshift(x, 31) * _UNMIX[0]) & _MASK63
    if x >> _PID_BITS != seed & 0xFFFFFF:
        return None
    return (x & ((1 << _PID_BITS) - 1)) - 1


def error_reply(msg: Message, ex: BaseException) -> Message:
    """The reply Flower makes of an exception raised by a ClientApp on ``msg``."""
    return Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(ex).__name__}: {ex}"),
                   reply_to=msg)


class _Partitions(Mapping[int, int]):
    """Node id -> partition id of a LocalGrid, computed, not stored."""

    def __init__(self, num_nodes: int, seed: int) -> None:
        self.num_nodes, self.seed = num_nodes, seed

    def __getitem__(self, node: int) -> int:
        pid = partition_of_node(node, self.seed) if isinstance(node, int) else None
        if pid is None or not 0 <= pid < self.num_nodes:
            raise KeyError(node)
        return pid

    def __iter__(self) -> Iterator[int]:
        return (node_id(pid, self.seed) for pid in range(self.num_nodes))

    def __len__(self) -> int:
        return self.num_nodes


class LocalGrid(Grid):
    """Runs ``client_app`` for ``num_nodes`` virtual nodes with partition ids ``0..n-1``.

    Nothing is held per node until it is sent a message (its node id is computed from its
    partition id, its Context made then), so a grid of a million nodes costs what the
    clients it runs cost. The nodes' client keys are their partition ids (fedgc's
    ``client.app.client_key``), which :meth:`node_of_key` lets the server's registry use
    without a query per node (:class:`server.registry.KeyedGrid`), unless ``node_config``
    sets a ``client-key`` of its own.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs.
    num_nodes : int
        Number of nodes; node ``i`` gets ``node_config = {"partition-id": i, "num-partitions": n}``.
    seed : int (default: 0)
        Seed of the (random-looking, 63-bit) node ids, so that code which must not rely on them
        is exercised.
    node_config : mapping, optional
        Extra keys for every node's ``node_config``.
    intercept : callable, optional
        ``intercept(reply) -> reply or None`` applied to each reply; None drops it (a timeout).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, seed: int = 0,
                 node_config: Mapping[str, bool | int | float | str] | None = None,
                 intercept: Callable[[Message], Message | None] | None = None) -> None:
        if TaskIdentity._run_id is None:  # noqa: SLF001 - what run_simulation sets up, too
            # Messages read the sender's identity from here; the simulation engine sets it
            # in the same way for the in-process ServerApp.
            TaskIdentity.run_id, TaskIdentity.task_id = 1, 1
            TaskIdentity.node_id = SUPERLINK_NODE_ID
        self.client_app = client_app
        self.intercept = intercept
        self.seed = int(seed)
        self.num_nodes = int(num_nodes)
        self.partition_of: Mapping[int, int] = _Partitions(self.num_nodes, self.seed)
        self.node_config = dict(node_config or {})
        #: Whether the nodes' client keys are their partition ids (KeyedGrid).
        self.keys_are_partitions = "client-key" not in self.node_config
        self.contexts: dict[int, Context] = {}  # made when a node is first sent a message
        self._inbox: dict[str, Message] = {}
        self._run = None

    def context_of(self, node: int) -> Context:
        """The Context of ``node``, made on its first message and kept for the run (a
        ClientApp may keep state in it, as on Flower's engines)."""
        context = self.contexts.get(node)
        if context is None:
            pid = self.partition_of[node]
            context = self.contexts[node] = Context(
                run_id=1, node_id=node,
                node_config={"partition-id": pid, "num-partitions": self.num_nodes,
                             **self.node_config},
                state=RecordDict(), run_config={})
        return context

    @property
    def num_keys(self) -> int:
        """Client keys are ``0..num_keys-1`` (KeyedGrid)."""
        return self.num_nodes

    def node_of_key(self, key: int) -> int:
        """The node whose client key is ``key`` (KeyedGrid)."""
        return node_id(key, self.seed)

    def set_run(self, run) -> None:  # noqa: ANN001 - Flower's Run
        """Remember the run (unused: one run per LocalGrid)."""
        self._run = run

    @property
    def run(self):  # noqa: ANN201 - Flower's Run
        """The run set with :meth:`set_run`."""
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """A new instruction message (Flower's deprecated Grid API)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Node ids, in no meaningful order (like Flower's in-memory state)."""
        return set(self.partition_of)  # one id per node: the registry asks KeyedGrid instead

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages for their nodes."""
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.partition_of:
                raise ValueError(f"message for unknown node {msg.metadata.dst_node_id}")
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self._inbox[msg.metadata.message_id] = copy.deepcopy(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the ClientApp on the queued messages now and return their replies."""
        replies = []
        for mid in message_ids:
            msg = self._inbox.pop(mid, None)
            if msg is None:
                continue
            context = self.context_of(msg.metadata.dst_node_id)
            try:
                reply = self.client_app(msg, context)
            except Exception as ex:  # a ClientApp exception becomes an error reply, as in Flower
                reply = error_reply(msg, ex)
            reply = self.deliver(reply)
            if reply is not None:
                replies.append(reply)
        return replies

    def deliver(self, reply: Message) -> Message | None:
        """A reply as the server receives it: copied, as a transport would, then
        ``intercept``-ed (None: dropped)."""
        reply = copy.deepcopy(reply)
        return self.intercept(reply) if self.intercept is not None else reply

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, run every node, return the replies (``timeout`` is not needed in-process)."""
        del timeout
        return list(self.pull_messages(list(self.push_messages(messages))))
