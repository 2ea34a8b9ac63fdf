"""LocalGrid: a Flower Grid that runs a ClientApp in this process, one node after another.

For tests and debugging: the messages are the real Flower Messages and the ClientApp is the real
one, but there is no Ray, no threads and no start-up cost, so a round is deterministic and fast.
Every message is deep-copied on the way in and out, as a transport would, so that neither side
can see the other's objects. Flower's simulation engine (Ray backend,
:func:`simulations.runner.run_engine`) remains what ``python -m simulations`` uses by default.
"""

from __future__ import annotations

import copy
import random
import uuid
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

#: Error code Flower uses for an exception raised inside a ClientApp.
CLIENT_APP_RAISED_EXCEPTION = 2


class LocalGrid(Grid):
    """Runs ``client_app`` for ``num_nodes`` virtual nodes with partition ids ``0..n-1``.

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
        rng = random.Random(seed)
        self.client_app = client_app
        self.intercept = intercept
        self.partition_of: dict[int, int] = {}
        while len(self.partition_of) < num_nodes:
            self.partition_of.setdefault(rng.getrandbits(63) or 1, len(self.partition_of))
        self.contexts = {
            node: Context(run_id=1, node_id=node,
                          node_config={"partition-id": pid, "num-partitions": num_nodes,
                                       **dict(node_config or {})},
                          state=RecordDict(), run_config={})
            for node, pid in self.partition_of.items()
        }
        self._inbox: dict[str, Message] = {}
        self._run = None

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
        return set(self.partition_of)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages for their nodes."""
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.contexts:
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
            context = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.client_app(msg, context)
            except Exception as ex:  # a ClientApp exception becomes an error reply, as in Flower
                reply = Message(Error(code=CLIENT_APP_RAISED_EXCEPTION,
                                      reason=f"{type(ex).__name__}: {ex}"), reply_to=msg)
            reply = copy.deepcopy(reply)
            if self.intercept is not None:
                reply = self.intercept(reply)
            if reply is not None:
                replies.append(reply)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, run every node, return the replies (``timeout`` is not needed in-process)."""
        del timeout
        return list(self.pull_messages(list(self.push_messages(messages))))
