"""What secure aggregation costs one client: the bytes of its messages at each stage, and the
round trips, as functions of its neighbours, the vector's length and the modulus.

The sizes are the encoded messages' (:mod:`fedgc.privacy.secagg.wire`: payload, not transport;
the Flower Message, gRPC or TLS framing that carries them adds its own), so that the emulator can
charge a client's four exchanges without running the cryptography. With no dropouts every
client's counts are its neighbours ``k``; with dropouts, pass the counts it saw
(``tests/test_secagg.py`` checks both against real messages).

Per client (``k`` neighbours, ``L`` coordinates of ``b`` bits; bytes)::

    stage           down (server -> client)    up (client -> server)
    setup           62                         97
    share keys      29 + 72 k                  69 + 140 k
    masked vector   29 + 108 k                 42 + ceil(L b / 8)
    unmask          33 + 8 k                   37 + 45 k

4 round trips where a plain round has 1. The masked vector replaces the method's payload; the
rest (373 k + 356 bytes a client: 10.8 KB at k = 28, the default for 100 clients) is what the
protocol adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgc.privacy.secagg.wire import SIZES, Masked

__all__ = ["ROUND_TRIPS", "STAGES", "StageBytes", "client_bytes", "overhead_bytes",
           "session_bytes"]

#: The protocol's stages, in order (Flower's names).
STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
#: Request-reply exchanges a client takes part in per secure round (1 for a plain round).
ROUND_TRIPS = len(STAGES)


@dataclass(frozen=True)
class StageBytes:
    """One stage's bytes for one client: ``down`` (its request), ``up`` (its reply)."""

    down: int
    up: int


def _records(kind: str, count: int) -> int:
    head, record = SIZES[kind]
    return head + count * record


def client_bytes(neighbours: int, length: int, modulus_bits: int, *,
                 listed: int | None = None, forwarded: int | None = None,
                 active: int | None = None, dropped: int = 0) -> dict[str, StageBytes]:
    """Each stage's bytes for a client of ``neighbours`` (``k``) when nobody drops, or with the
    counts it saw: ``listed`` neighbours' keys (stage 1), ``forwarded`` ciphertexts (stage 2),
    ``active`` and ``dropped`` neighbours named at the unmasking (stage 3)."""
    listed = neighbours if listed is None else listed
    forwarded = listed if forwarded is None else forwarded
    active = forwarded - dropped if active is None else active
    return {
        "setup": StageBytes(SIZES["setup"], SIZES["keys"]),
        "share_keys": StageBytes(_records("neighbours", listed), _records("shares", listed)),
        "collect_masked_vectors": StageBytes(_records("forward", forwarded),
                                             Masked.size(length, modulus_bits)),
        "unmask": StageBytes(_records("survivors", active + dropped),
                             _records("reveal", active + dropped)),
    }


def overhead_bytes(neighbours: int, length: int, modulus_bits: int) -> int:
    """Bytes a client's round adds to its masked vector when nobody drops (both ways)."""
    stages = client_bytes(neighbours, length, modulus_bits)
    return sum(s.down + s.up for s in stages.values()) - Masked.size(length, modulus_bits)


def session_bytes(clients: int, neighbours: int, length: int,
                  modulus_bits: int) -> StageBytes:
    """All clients' bytes of a session with no dropout (down: the server's requests)."""
    stages = client_bytes(neighbours, length, modulus_bits).values()
    return StageBytes(clients * sum(s.down for s in stages), clients * sum(s.up for s in stages))
