"""A client's record wherever its round runs: the record the server knows it has, or an error.

On a Ray cluster a client's rounds run on whichever node has a free actor. Its record (residual,
momentum, pending update) must then live in a store every node reaches: the folder store
(:class:`client.state.ClientStateStore`) on a filesystem every node mounts at the same path
(docs/cluster.md says why that and not a key-value server, with measurements). If it does not
(a node-local folder, a mount missing on one node), a client would find no record, or the
record of an older round, and DGC's error feedback would silently restart from zero.

The server tells every client which of its updates it last aggregated (``ack_sequence``). A
client's record (of a method that keeps a residual) is rewritten every time it trains, with the
round it answered; so a client that was aggregated in round ``a`` must find a record of round
``a`` or later. :func:`read_state` checks that, and says so with a :class:`StateMissingError`;
writing nothing itself, it leaves the decision to the caller: ``client.app`` logs it and starts
the client over from the global model with an empty residual, counted as ``state_quarantined``
(the loss is then visible, never silent, and the client is not shut out of the run).
"""

from __future__ import annotations

import dgc
from client.state import ClientState, ClientStateStore, StateStoreError
from dgc.wire import MAX_NUMEL


class StateMissingError(StateStoreError):
    """The store lacks the record of a round the server aggregated (or holds an older one)."""


def state_sequence(state: ClientState) -> int | None:
    """The round whose reply ``state`` was written with, or None when it holds no reply."""
    if state.reply is not None and "sequence" in state.reply:
        return int(state.reply["sequence"])
    if state.pending is not None:  # records written before "reply" was kept
        # The client's own bytes from its own store: bounded by the format alone.
        return dgc.decode(state.pending, max_numel=MAX_NUMEL).sequence
    return None


def read_state(store: ClientStateStore, key: str, ack_sequence: int, keeps_residual: bool,
               where: str = "") -> ClientState | None:
    """``key``'s state from ``store`` (None for a client without one yet), checked against the
    server's ``ack_sequence``.

    Only clients whose method keeps a residual (``keeps_residual``: dgc, stc) keep state the
    server's aggregate depends on; for them a missing record, or one older than
    ``ack_sequence``, is a StateMissingError that names the store and ``where`` (this
    process's node). The fresh state that replaced a
    quarantined record passes: its loss was detected and is reported. A damaged record is the
    store's StateCorruptError (``client.app`` quarantines it). Neither writes anything.
    """
    state = store.load(key)
    if (not keeps_residual or ack_sequence < 0
            or (state is not None and state.quarantined)):
        # A fresh state after a quarantine: the loss is known and reported, not silent.
        return state
    on = f" on {where}" if where else ""
    if state is None:
        raise StateMissingError(
            f"client {key}: the server aggregated its update of round {ack_sequence}, but "
            f"{store.root}{on} holds no record of this client; its residual would restart "
            f"from zero. Is state_dir on a filesystem every node mounts? (docs/cluster.md)")
    written = state_sequence(state)
    if written is None or written < ack_sequence:
        raise StateMissingError(
            f"client {key}: the server aggregated its update of round {ack_sequence}, but the "
            f"record in {store.root}{on} was written in round {written}: an older copy; its "
            f"residual would lose the rounds since. Is state_dir on a filesystem every node "
            f"mounts? (docs/cluster.md)")
    return state
