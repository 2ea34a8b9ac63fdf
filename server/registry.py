"""The client registry: which node is which client, what each client acknowledged and may
hold, and the seeded sampling of a round's clients.

Clients are known by a stable key (what a query message asks once per node): node ids change
with every simulation run, partition ids do not.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from typing import Any, Protocol, runtime_checkable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedgc import protocol as P

#: Seconds of waiting for SuperNodes after which :meth:`ClientRegistry.wait_for_nodes` says how
#: to size a simulated federation.
HINT_AFTER_S = 10.0


class NoClientsError(RuntimeError):
    """No connected node may serve this run (every one refused, or none identified) for as
    long as a round may wait: a round without clients is never run, nor counted as done."""


@runtime_checkable
class KeyedGrid(Protocol):
    """A grid that knows its nodes' client keys (``server.local_grid.LocalGrid``): the keys are
    ``0..num_keys-1`` and :meth:`node_of_key` names each one's node, so the registry samples a
    round without a query per node nor a list of them (a million nodes cost nothing per
    round). Used only while ``keys_are_partitions`` is true."""

    keys_are_partitions: bool

    @property
    def num_keys(self) -> int: ...

    def node_of_key(self, key: int) -> int: ...


@dataclass
class ClientInfo:
    """What the server knows of one client between rounds."""

    acked: int = -1  # the sequence (round) of its last aggregated update; -1: none
    versions: list[int] = field(default_factory=list)  # model versions it may hold


@dataclass(frozen=True)
class RoundOutcome:
    """How one sampled client's round ended, as the registry's bookkeeping needs it."""

    client_key: int
    status: str  # aggregated | surplus | rejected | error | timeout
    reason: str = ""  # an error's text (a client that lost the run's config says so in it)


class ClientRegistry:
    """Node ids, acknowledgements, held versions and sampling.

    Parameters
    ----------
    seed : int
        Seed of the sampling (per round: ``Random(seed * 1000003 + round)``).
    initial_versions : list of int
        What a client the server never heard from holds: ``[0]`` when clients build version
        0 of the model themselves, else ``[]`` (the dense model first).
    """

    def __init__(self, seed: int = 0, initial_versions: Iterable[int] = ()) -> None:
        self.seed = int(seed)
        self.initial_versions = list(initial_versions)
        self.clients: dict[int, ClientInfo] = {}
        self.node_keys: dict[int, int] = {}  # node id -> client key, in identification order
        # Client key -> digest of the run config it holds (fedgc.protocol.config_digest), as
        # far as its replies tell. Not checkpointed: a resumed server sends it whole once more.
        self.config_held: dict[int, str] = {}
        self.num_clients: int | None = None  # keys accepted: [0, num_clients); None: any
        self.bound: dict[int, int] | None = None  # node id -> its one key (client_nodes)
        self.refused: dict[int, str] = {}  # node id -> why its claim was refused

    def bind(self, num_clients: int, client_nodes: Mapping[int, int] | None = None) -> None:
        """Accept only client keys in ``[0, num_clients)`` and, with ``client_nodes`` (client
        key -> authenticated node id, the run key of that name), only the key each listed node
        is bound to: a node's claim is otherwise all the server knows of it.

        Nodes already registered whose claim does not pass are forgotten.
        """
        self.num_clients = int(num_clients)
        self.bound = None if not client_nodes else {
            int(node): int(key) for key, node in client_nodes.items()}
        for node, key in list(self.node_keys.items()):
            if self._refuse(node, key):
                del self.node_keys[node]

    def _refuse(self, node: int, key: int) -> bool:
        """Whether ``node``'s claim of ``key`` is refused (logged once per node, kept in
        :attr:`refused` so that the node is not asked again)."""
        why = None
        if self.num_clients is not None and not 0 <= key < self.num_clients:
            shown = str(key) if len(str(key)) <= 24 else f"{str(key)[:20]}... ({len(str(key))} " \
                f"digits)"
            why = (f"claims client key {shown}, outside [0, {self.num_clients}) (num_clients = "
                   f"{self.num_clients})")
        elif self.bound is not None and node not in self.bound:
            why = "is not one of the authenticated nodes client_nodes lists"
        elif self.bound is not None and self.bound[node] != key:
            why = f"claims client key {key}, but client_nodes binds it to key {self.bound[node]}"
        if why is None:
            return False
        if node not in self.refused:
            log(WARNING, "node %d %s: it will not be sampled", node, why)
        self.refused[node] = why
        return True

    def register(self, node_keys: Mapping[int, int]) -> None:
        """Record node id -> client key pairs (what the identification query learns); a claim
        :meth:`bind` refuses is left out."""
        for node, key in node_keys.items():
            self.node_keys.pop(int(node), None)  # re-registering moves the node to the newest
            if not self._refuse(int(node), int(key)):
                self.node_keys[int(node)] = int(key)

    def key_of(self, node_id: int) -> int:
        """The client key of ``node_id`` (-1: unknown)."""
        return self.node_keys.get(node_id, -1)

    def nodes_by_key(self, node_ids: list[int]) -> dict[int, int]:
        """Client key -> the node to message, among the connected ``node_ids``.

        A SuperNode that crashed and came back has a new node id, while the SuperLink may still
        list the dead one as online for a while: when several connected nodes carry one key,
        the most recently identified one wins (``node_keys`` keeps identification order).
        """
        online = set(node_ids)
        node_of: dict[int, int] = {}
        for node, key in self.node_keys.items():
            if node in online:
                node_of[key] = node
        return node_of

    def wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        """The connected node ids, once there are at least ``needed``.

        After :data:`HINT_AFTER_S` seconds of waiting it warns once how to size a simulated
        federation: under ``flwr run``, Flower's default of 2 SuperNodes leaves a run with
        more clients per round waiting for ever.
        """
        started = time.monotonic()
        hinted = False
        while len(node_ids := sorted(grid.get_node_ids())) < needed:
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).",
                len(node_ids), needed)
            if not hinted and time.monotonic() - started >= HINT_AFTER_S:
                hinted = True
                log(WARNING, "only %d SuperNodes are connected and this run needs %d: on "
                    "Flower's simulation runtime, start it with `flwr run . "
                    "--federation-config num-supernodes=N`, N = num_clients "
                    "(docs/federation.md)", len(node_ids), needed)
            time.sleep(1)
        return node_ids

    def identify(self, grid: Grid, node_ids: list[int], timeout: float) -> None:
        """Ask every node not yet known for its client key (one query message each).

        A key another node served before is now served by a new SuperNode process (a crashed
        node back under a new node id): the run config the old one held lived in Flower's
        context, which a new process starts without, so the server forgets that the key holds
        it and sends it whole at once (else the client's first round back fails with
        :data:`fedgc.protocol.CONFIG_MISSING`, seen in a deployment's crash test).
        """
        unknown = [n for n in node_ids if n not in self.node_keys and n not in self.refused]
        if not unknown:
            return
        served = set(self.node_keys.values())
        messages = [Message(RecordDict({P.CONFIG: ConfigRecord({"ask": P.CLIENT_KEY})}),
                            dst_node_id=n, message_type=MessageType.QUERY) for n in unknown]
        for msg in grid.send_and_receive(messages, timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error():
                log(WARNING, "node %d did not identify itself: %s", node, msg.error.reason)
                continue
            metrics = msg.content.metric_records.get(P.METRICS)
            key = None if metrics is None else metrics.get(P.CLIENT_KEY)
            if isinstance(key, float) and key.is_integer():
                key = int(key)
            if isinstance(key, bool) or not isinstance(key, int):
                log(WARNING, "node %d sent no client key (got %.80r)", node, key)
                continue
            if not self._refuse(node, key):
                if key in served:
                    self.config_held.pop(key, None)
                self.node_keys[node] = key
        missing = len([n for n in unknown if n not in self.node_keys])
        if missing:
            log(WARNING, "%d of %d new nodes are unidentified or refused and will not be "
                "sampled", missing,
                len(unknown))

    def sample_round(self, grid: Grid, server_round: int, count: int, min_nodes: int,
                     timeout: float) -> tuple[dict[int, int], int]:
        """Client key -> node id of the clients sampled in ``server_round`` (``count`` of the
        connected, identified ones, in sampling order), and how many nodes are connected.

        Waits for ``min_nodes`` connected nodes, and asks new ones for their key first
        (``timeout``: seconds to wait for their answers).
        """
        # The fast path trusts the grid, not the nodes: a node's key is the partition the grid
        # gave it, asked of no one. Keys outside the run stay unsampled (bind), and with
        # client_nodes every node is identified and checked against its binding instead.
        if isinstance(grid, KeyedGrid) and grid.keys_are_partitions and self.bound is None \
                and grid.num_keys >= min_nodes:
            known = (grid.num_keys if self.num_clients is None
                     else min(grid.num_keys, self.num_clients))
            keys = self.sample(server_round, range(known), count)
            node_of = {k: grid.node_of_key(k) for k in keys}
            self.register({node: key for key, node in node_of.items()})
            return node_of, grid.num_keys
        node_ids, node_of = self.wait_for_clients(grid, min_nodes, timeout)
        return {k: node_of[k] for k in self.sample(server_round, list(node_of), count)}, \
            len(node_ids)

    def wait_for_clients(self, grid: Grid, min_nodes: int,
                         timeout: float) -> tuple[list[int], dict[int, int]]:
        """The connected node ids once ``min_nodes`` are, and client key -> node of those that
        may serve this run, once there is one: waited for up to ``timeout`` seconds, asking
        each new node for its key.

        Raises
        ------
        NoClientsError
            ``timeout`` passed with no connected node that may serve this run (each one refused,
            ``client_nodes`` naming none of them, or none identified).
        """
        deadline = time.monotonic() + timeout
        while True:
            node_ids = self.wait_for_nodes(grid, min_nodes)
            self.identify(grid, node_ids, timeout)
            node_of = self.nodes_by_key(node_ids)
            if node_of:
                return node_ids, node_of
            if time.monotonic() >= deadline:
                break
            log(WARNING, "none of the %d connected nodes may serve this run; waiting %.0f s "
                "more", len(node_ids), deadline - time.monotonic())
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        why = "; ".join(f"node {n} {self.refused[n]}" for n in node_ids[:3] if n in self.refused)
        bound = "" if self.bound is None else \
            f" client_nodes binds the nodes {sorted(self.bound)[:5]};"
        raise NoClientsError(
            f"none of the {len(node_ids)} connected nodes may serve this run after "
            f"{timeout:g} s (round_timeout_s):{bound} {why or 'none identified itself'}; a "
            f"round without clients is not run")

    def sample(self, server_round: int, keys: Sequence[int], count: int) -> list[int]:
        """``count`` of ``keys`` (all when fewer), reproducible from the seed and the round,
        whatever order ``keys`` come in. A ``range`` is sampled as the sorted list it equals,
        without building it (the same draw, in O(count))."""
        rng = random.Random(self.seed * 1_000_003 + server_round)
        population = keys if isinstance(keys, range) and keys.step > 0 else sorted(keys)
        return rng.sample(population, min(len(keys), count))

    def held(self, key: int) -> tuple[int, ...]:
        """The model versions client ``key`` may hold, sorted (``()``: none known)."""
        info = self.clients.get(key)
        return tuple(sorted(self.initial_versions if info is None else info.versions))

    def acked(self, key: int) -> int:
        """The sequence of client ``key``'s last aggregated update (-1: none)."""
        info = self.clients.get(key)
        return -1 if info is None else info.acked

    def holds_config(self, key: int, digest: str) -> bool:
        """Whether client ``key`` is known to hold the run config of ``digest``."""
        return self.config_held.get(key) == digest

    def settle(self, server_round: int, outcomes: Iterable[RoundOutcome], version_sent: int,
               processed: Iterable[int] = (), dense_only: bool = False,
               config_digest: str = "") -> None:
        """Record what each sampled client acknowledged and may hold after ``server_round``.

        ``processed``: clients known to have processed the round's message although their
        reply was not aggregated nor refused (the network emulator's late replies).
        ``dense_only``: clients will be sent the dense model whatever they hold.
        ``config_digest``: the digest of the run config the round's messages named; a client
        that answered with content holds it, one whose error says it lacks it
        (:data:`fedgc.protocol.CONFIG_MISSING`) will be sent it whole.
        """
        done = set(processed)
        for outcome in outcomes:
            if config_digest and (outcome.status in ("aggregated", "surplus", "rejected")
                                  or outcome.client_key in done):
                self.config_held[outcome.client_key] = config_digest
            elif outcome.status == "error" and P.CONFIG_MISSING in outcome.reason:
                self.config_held.pop(outcome.client_key, None)
            info = self.clients.setdefault(outcome.client_key,
                                           ClientInfo(versions=list(self.initial_versions)))
            if outcome.status == "aggregated":
                info.acked = server_round
            if dense_only or outcome.status == "error":
                info.versions = []  # dense next time
            elif outcome.status in ("aggregated", "surplus", "rejected") \
                    or outcome.client_key in done:
                # It answered with content, so it processed the message and holds what we sent.
                info.versions = [version_sent]
            elif info.versions:
                # No answer: it holds what it held, or what we sent if the message reached it.
                info.versions = sorted(set(info.versions) | {version_sent})
            # else: it held nothing we know of and may not have received the model: dense.

    def state_dict(self) -> dict[str, Any]:
        """The registry's part of the strategy state (flat checkpoint keys)."""
        return {
            "clients": {str(k): asdict(v) for k, v in self.clients.items()},
            # Node ids live as long as their SuperNodes: a ServerApp resumed in the same
            # deployment messages them without asking again (in simulation they are just stale).
            "node_keys": {str(n): k for n, k in self.node_keys.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (migrated by ``server.checkpoint``)."""
        self.clients = {int(k): ClientInfo(int(v["acked"]), [int(u) for u in v["versions"]])
                        for k, v in state["clients"].items()}
        self.register({int(n): int(k) for n, k in state.get("node_keys", {}).items()})
