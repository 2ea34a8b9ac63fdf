"""A client's record wherever its round runs: the record the server knows it has, or an error.

On a Ray cluster a client's rounds run on whichever node has a free actor. Its record (residual,
momentum, pending update) must then live in a store every node reaches: the folder store
(:class:`client.state.ClientStateStore`) on a filesystem every node mounts at the same path
(docs/cluster.md says why that and not a key-value server, with measurements). If it does not
(a node-local folder, a mount missing on one node), a client would find no record, or the
record of an older round, and DGC's error feedback would silently restart from zero.

The server tells every client which of its updates it last aggregated (``ack_sequence``). A
``dgc`` client's record is rewritten every time it trains, with the round it answered; so a
client that was aggregated in round ``a`` must find a record of round ``a`` or later.
:func:`read_record` checks that, and a client that cannot read what it should have fails its
round with a :class:`StateMissingError` that says so: it writes nothing, so whatever record
exists elsewhere is kept, and the server counts the round as an error for that client.
"""

from __future__ import annotations

from typing import Any

import dgc
from client.state import ClientStateStore, StateStoreError, stored_bytes


class StateMissingError(StateStoreError):
    """The store lacks the record of a round the server aggregated (or holds an older one)."""


def record_sequence(record: dict[str, Any]) -> int | None:
    """The round whose reply ``record`` was written with, or None when it holds no reply."""
    reply = record.get("reply")
    if isinstance(reply, dict) and "sequence" in reply:
        return int(reply["sequence"])
    if record.get("pending") is not None:  # records written before "reply" was kept
        return dgc.decode(stored_bytes(record, "pending")).sequence
    return None


def read_record(store: ClientStateStore, key: str, ack_sequence: int, method: str,
                where: str = "") -> dict[str, Any]:
    """``key``'s record from ``store`` ({} for a client without one yet), checked against the
    server's ``ack_sequence``.

    Only ``dgc`` clients keep state the server's aggregate depends on (their residual); for
    them a missing record, or one older than ``ack_sequence``, is a StateMissingError that
    names the store and ``where`` (this process's node). A damaged record is the store's
    StateStoreError. Neither writes anything.
    """
    record = store.get(key)
    if method != "dgc" or ack_sequence < 0:
        return record or {}
    on = f" on {where}" if where else ""
    if record is None:
        raise StateMissingError(
            f"client {key}: the server aggregated its update of round {ack_sequence}, but "
            f"{store.root}{on} holds no record of this client; its residual would restart "
            f"from zero. Is state_dir on a filesystem every node mounts? (docs/cluster.md)")
    written = record_sequence(record)
    if written is None or written < ack_sequence:
        raise StateMissingError(
            f"client {key}: the server aggregated its update of round {ack_sequence}, but the "
            f"record in {store.root}{on} was written in round {written}: an older copy; its "
            f"residual would lose the rounds since. Is state_dir on a filesystem every node "
            f"mounts? (docs/cluster.md)")
    return record
