"""The server half of secure aggregation: SecAgg+ (Bell et al., CCS 2020) as a session object.

A :class:`ServerSession` sums one integer vector per client modulo ``2^b`` and learns nothing
else of any one vector, while clients drop out between its four stages (the stages and message
names are Flower's ``SecAggPlusWorkflow``'s; :mod:`fedgc.privacy.secagg.wire` has the bytes)::

    setup()                  -> setup requests          stage 0: the session's parameters
    share_keys(keys)         -> neighbours' keys        stage 1: public keys to each neighbour
    collect_masked_vectors(shares) -> forwarded shares  stage 2: ciphertexts to their targets
    unmask(masked)           -> survivors               stage 3: who is active, who dropped
    result(reveals)          -> the sum (uint64 ring)

Each call takes the replies of the stage before as ``{client id: bytes}``; a client missing from
them dropped out there. The session carries them through transport it does not know (Flower
Messages, the phone bridge's gRPC, the emulator), so that whoever carries them can count each
message's bytes and round trips.

How dropouts are recovered: a client that sent its keys but not its shares is left out of its
neighbours' masks (they never get its shares). One that sent shares but not its masked vector
left pairwise masks in its neighbours' vectors: the server rebuilds its mask key's seed from
``threshold`` of its neighbours' shares and removes them. One that sent its vector and then
dropped is in the sum: its self mask is removed from its self seed, rebuilt the same way. Where
fewer than ``threshold`` holders of a needed seed are left, or fewer than ``min_survivors``
vectors, the session ends with :class:`ThresholdError` and no sum. Before any vector is sent
(stages 0 and 1) the session instead drops the clients that could no longer be recovered and
goes on with the rest.

An untrusted client cannot crash or steer the session: a reply that does not decode, names
another session or client, or does not fit what was asked (a target missing, a share that
fails its commitment) is rejected whole, with its reason in :attr:`ServerSession.rejected`,
and the client counts as dropped at that stage. A vector outside the agreed range cannot be
detected here (it is masked); :meth:`fedgc.privacy.FixedPoint.decode_sum` checks the sum's
range.

Threat model (docs/threat_model.md): an honest-but-curious server, which follows the protocol
but keeps everything it sees, learns only the sum, provided that fewer than ``threshold`` of
any client's neighbours collude with it; a server that lies about who dropped (actively
malicious) is out of scope, as in Flower's implementation (Bell et al. add a consistency round
with signatures for it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from fedgc.privacy.secagg import crypto
from fedgc.privacy.secagg.client import check_setup
from fedgc.privacy.secagg.errors import BadMessage, SecAggError, StageError, ThresholdError
from fedgc.privacy.secagg.graph import default_neighbours, default_threshold, neighbour_graph
from fedgc.privacy.secagg.wire import (
    MASK_SEED,
    SELF_SEED,
    Forward,
    Keys,
    Masked,
    Neighbours,
    Reveal,
    Setup,
    Shares,
    Survivors,
)

__all__ = ["ServerSession"]

_MAX_ID = (1 << 64) - 1
T = TypeVar("T")


class ServerSession:
    """One secure sum over ``clients`` (module docstring).

    Parameters
    ----------
    clients : sequence of int
        The sampled clients' ids (distinct u64).
    length : int
        Coordinates of every vector.
    modulus_bits : int
        ``b``: vectors and their sum are integers modulo ``2^b`` (1 to 62).
    neighbours : int or None
        ``k``, each client's neighbours in the graph (:func:`default_neighbours` of the count of
        clients when None): even and below ``n - 1``, or ``n - 1`` (everyone).
    threshold : int or None
        ``t``, shares that rebuild a client's seed: a strict majority of ``k``
        (:func:`default_threshold` when None).
    min_survivors : int or None
        The fewest masked vectors the server unmasks a sum of (``max(2, t)`` when None): a sum
        of one would be that client's vector.
    server_round : int
        The round, sent to clients (an id, not checked here).
    rng : random.Random or None
        The permutation of the neighbour graph (the OS's CSPRNG when None; tests seed it).
    """

    def __init__(self, clients: Sequence[int], length: int, modulus_bits: int, *,
                 neighbours: int | None = None, threshold: int | None = None,
                 min_survivors: int | None = None, server_round: int = 0,
                 rng: random.Random | None = None) -> None:
        ids = [int(c) for c in clients]
        if len(set(ids)) != len(ids) or any(not 0 <= c <= _MAX_ID for c in ids):
            raise SecAggError("clients must be distinct u64 ids")
        if len(ids) < 2:
            raise SecAggError(f"{len(ids)} clients: a secure sum needs at least 2")
        k = default_neighbours(len(ids)) if neighbours is None else int(neighbours)
        t = default_threshold(k) if threshold is None else int(threshold)
        self.min_survivors = max(2, t) if min_survivors is None else int(min_survivors)
        if not 2 <= self.min_survivors <= len(ids):
            raise SecAggError(f"min_survivors = {self.min_survivors}: expected 2 to {len(ids)}")
        self.session = crypto.new_seed()
        self.length, self.modulus_bits = int(length), int(modulus_bits)
        self.neighbours, self.threshold = k, t
        self.server_round = int(server_round)
        self.clients = tuple(ids)
        # The client's own checks refuse what the server must not propose either.
        try:
            check_setup(self._setup(ids[0]), ids[0])
        except BadMessage as ex:
            raise SecAggError(str(ex).replace("setup request refused", "session refused")) \
                from None
        self.graph = neighbour_graph(ids, k, rng)
        self.stage = "setup"
        #: Clients still in the session.
        self.alive: set[int] = set(ids)
        #: Why each client left: the stage it did not answer, or its rejected reply's reason.
        self.dropped: dict[int, str] = {}
        #: Replies refused, by client: the reason.
        self.rejected: dict[int, str] = {}
        #: Clients whose vectors are in the sum (after :meth:`unmask`).
        self.summed: tuple[int, ...] = ()
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._listed: dict[int, tuple[int, ...]] = {}  # neighbours each was sent keys of
        self._commitments: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # (owner, holder)
        self._seed_commitments: dict[int, bytes] = {}
        self._forwarded: dict[int, tuple[int, ...]] = {}  # holder -> owners it holds shares of
        self._asked: dict[int, Survivors] = {}
        self._total: np.ndarray | None = None
        self._dead: set[int] = set()  # sent shares, not their vector

    def client_counts(self, client: int) -> dict[str, int]:
        """What ``client`` was sent so far, as :func:`fedgc.privacy.secagg.cost.client_bytes`
        takes it: neighbours ``listed`` with their keys, ciphertexts ``forwarded``, neighbours
        named ``active`` and ``dropped`` at the unmasking."""
        asked = self._asked.get(client)
        return {"listed": len(self._listed.get(client, ())),
                "forwarded": len(self._forwarded.get(client, ())),
                "active": 0 if asked is None else len(asked.active),
                "dropped": 0 if asked is None else len(asked.dropped)}

    # ------------------------------------------------------------------ helpers
    def _setup(self, client: int) -> Setup:
        return Setup(self.session, self.server_round, client, len(self.clients),
                     self.neighbours, self.threshold, self.length, self.modulus_bits)

    def _enter(self, stage: str, following: str) -> None:
        if self.stage != stage:
            raise StageError(f"session {self.session.hex()}: {following} called at stage "
                             f"{self.stage}, expected at {stage}")

    def _fail(self, message: str) -> ThresholdError:
        self.stage = "failed"
        return ThresholdError(message)

    def _leave(self, clients: set[int], why: str) -> None:
        for c in sorted(clients & self.alive):
            self.dropped.setdefault(c, why)
        self.alive -= clients

    def _read(self, replies: Mapping[int, bytes], stage: str,
              read: Callable[[int, bytes], T]) -> dict[int, T]:
        """The replies of clients still alive that ``read`` accepts; the others are recorded
        (rejected with the reason, or dropped at ``stage``)."""
        good: dict[int, T] = {}
        for client, data in replies.items():
            if client not in self.alive:
                self.rejected[client] = f"a {stage} reply from a client not in this stage"
                continue
            try:
                good[client] = read(client, data)
            except SecAggError as ex:
                self.rejected[client] = str(ex)
                self.dropped[client] = f"{stage}: rejected ({ex})"
        self._leave(self.alive - set(good), f"{stage}: no reply")
        return good

    def _own(self, client: int, session: bytes, sender: int, what: str) -> None:
        if session != self.session or sender != client:
            raise BadMessage(f"{what} of client {client} names session {session.hex()} and "
                             f"client {sender}; expected {self.session.hex()} and {client}")

    def _prune(self, holders: Callable[[int], set[int]], stage: str) -> None:
        """Drop, until none is left, every client fewer than ``threshold`` of whose neighbours
        could hold its shares, then refuse the session below ``min_survivors``."""
        while True:
            short = {c for c in self.alive if len(holders(c) & self.alive) < self.threshold}
            if not short:
                break
            self._leave(short, f"{stage}: fewer than {self.threshold} neighbours left")
        if len(self.alive) < self.min_survivors:
            raise self._fail(f"session {self.session.hex()}: {len(self.alive)} clients left "
                             f"after {stage}, fewer than min_survivors = {self.min_survivors}")

    # ------------------------------------------------------------------ stage 0
    def setup(self) -> dict[int, bytes]:
        """The setup request of every client."""
        self._enter("setup", "setup")
        self.stage = "keys"
        return {c: self._setup(c).encode() for c in self.clients}

    # ------------------------------------------------------------------ stage 1
    def share_keys(self, replies: Mapping[int, bytes]) -> dict[int, bytes]:
        """From the clients' public keys, each client's request with its neighbours' keys."""
        self._enter("keys", "share_keys")

        def read(client: int, data: bytes) -> Keys:
            keys = Keys.decode(data)
            self._own(client, keys.session, keys.client, "public keys")
            if keys.cipher_key == keys.mask_key:
                raise BadMessage(f"public keys of client {client}: both keys are equal")
            crypto.check_public(keys.cipher_key, client)
            crypto.check_public(keys.mask_key, client)
            return keys

        got = self._read(replies, "setup", read)
        owners: dict[bytes, set[int]] = {}
        for client, keys in got.items():
            for k in (keys.cipher_key, keys.mask_key):
                owners.setdefault(k, set()).add(client)
        copied = {c for holders in owners.values() if len(holders) > 1 for c in holders}
        for c in copied:
            self.rejected[c] = "public keys: a key another client also sent"
        self._leave(copied, "setup: rejected (a public key another client also sent)")
        self._keys = {c: (k.cipher_key, k.mask_key) for c, k in got.items() if c in self.alive}
        self._prune(lambda c: set(self.graph[c]), "setup")
        out = {}
        for c in sorted(self.alive):
            listed = tuple(sorted(set(self.graph[c]) & self.alive))
            self._listed[c] = listed
            out[c] = Neighbours(self.session, tuple((p, *self._keys[p]) for p in listed)).encode()
        self.stage = "shares"
        return out

    # ------------------------------------------------------------------ stage 2
    def collect_masked_vectors(self, replies: Mapping[int, bytes]) -> dict[int, bytes]:
        """From the clients' encrypted shares, each client's request with the ciphertexts its
        neighbours sent it."""
        self._enter("shares", "collect_masked_vectors")

        def read(client: int, data: bytes) -> Shares:
            shares = Shares.decode(data)
            self._own(client, shares.session, shares.client, "shares")
            targets = sorted(r[0] for r in shares.records)
            if targets != list(self._listed[client]):
                raise BadMessage(f"shares of client {client} go to {targets[:8]}, its "
                                 f"neighbours are {list(self._listed[client])[:8]}")
            return shares

        got = self._read(replies, "share keys", read)
        self._prune(lambda c: set(self._listed[c]), "share keys")
        forward: dict[int, list[tuple[int, bytes]]] = {c: [] for c in self.alive}
        for owner in sorted(self.alive):
            shares = got[owner]
            self._seed_commitments[owner] = shares.seed_commitment
            for target, c_self, c_key, ciphertext in shares.records:
                if target in self.alive:
                    self._commitments[(owner, target)] = (c_self, c_key)
                    forward[target].append((owner, ciphertext))
        self._forwarded = {c: tuple(o for o, _ in forward[c]) for c in forward}
        self.stage = "masked"
        return {c: Forward(self.session, tuple(forward[c])).encode() for c in sorted(forward)}

    # ------------------------------------------------------------------ stage 3
    def unmask(self, replies: Mapping[int, bytes]) -> dict[int, bytes]:
        """From the masked vectors, each sender's request for the shares that unmask the sum."""
        self._enter("masked", "unmask")
        modulus = np.uint64((1 << self.modulus_bits) - 1)

        def read(client: int, data: bytes) -> Masked:
            masked = Masked.decode(data, self.length, self.modulus_bits)
            self._own(client, masked.session, masked.client, "masked vector")
            return masked

        expected = set(self.alive)
        got = self._read(replies, "masked vector", read)
        dead = expected - set(got)
        masked = set(got)
        if len(masked) < self.min_survivors:
            raise self._fail(f"session {self.session.hex()}: {len(masked)} masked vectors, "
                             f"fewer than min_survivors = {self.min_survivors}")
        for owner in sorted(expected):
            holders = {h for h in masked if owner in self._forwarded[h]}
            if owner in dead and not holders:
                dead.discard(owner)  # no vector in the sum holds its masks: nothing to remove
                continue
            if len(holders) < self.threshold:
                kind = "self mask" if owner in masked else "pairwise masks (it dropped)"
                raise self._fail(f"session {self.session.hex()}: client {owner}'s {kind} need "
                                 f"{self.threshold} shares, only {len(holders)} of their "
                                 f"holders sent a vector")
        total = np.zeros(self.length, dtype=np.uint64)
        for client in sorted(masked):
            total += got[client].vector  # wraps modulo 2^64, a multiple of the modulus
        self._total = total & modulus
        self._dead = dead
        self.summed = tuple(sorted(masked))
        self._asked = {h: Survivors(self.session,
                                    tuple(o for o in self._forwarded[h] if o in masked),
                                    tuple(o for o in self._forwarded[h] if o in dead))
                       for h in self.summed}
        self.stage = "unmask"
        return {h: s.encode() for h, s in self._asked.items()}

    # ------------------------------------------------------------------ the sum
    def result(self, replies: Mapping[int, bytes]) -> np.ndarray:
        """The sum modulo ``2^b`` of the vectors of :attr:`summed`, from the revealed shares."""
        self._enter("unmask", "result")
        good: dict[tuple[int, int], list[tuple[int, bytes]]] = {}  # (owner, kind) -> shares
        for holder, data in replies.items():
            try:
                shares = self._check_reveal(holder, data)
            except SecAggError as ex:
                self.rejected[holder] = str(ex)
                continue
            for owner, kind, share in shares:
                good.setdefault((owner, kind), []).append((holder, share))
        assert self._total is not None
        total = self._total.copy()
        bits = self.modulus_bits
        for owner in self.summed:
            seed = self._rebuild(owner, SELF_SEED, good)
            if crypto.commit_seed(self.session, owner, seed) != self._seed_commitments[owner]:
                raise self._dealer(owner, "self-mask seed")
            total -= crypto.mask(crypto.self_mask_key(seed, self.session, owner), self.length,
                                 bits)
        for owner in sorted(self._dead):
            private = crypto.key_pair(self._rebuild(owner, MASK_SEED, good))
            if crypto.public_bytes(private) != self._keys[owner][1]:
                raise self._dealer(owner, "mask key seed")
            for holder in self.summed:
                if owner not in self._forwarded[holder]:
                    continue  # it never masked with the dropped client
                key = crypto.agree(private, self._keys[holder][1], self.session, b"mask", owner,
                                   holder)
                # The holder added +mask when its id is the lower one: take out what it added.
                if holder < owner:
                    total -= crypto.mask(key, self.length, bits)
                else:
                    total += crypto.mask(key, self.length, bits)
        self.stage = "done"
        return total & np.uint64((1 << bits) - 1)

    def _check_reveal(self, holder: int, data: bytes) -> list[tuple[int, int, bytes]]:
        """The shares in ``holder``'s reveal, each checked against what was asked and against
        its owner's commitment; BadMessage for the whole reply otherwise."""
        if holder not in self._asked:
            raise BadMessage(f"revealed shares of client {holder}, which was not asked")
        reveal = Reveal.decode(data)
        self._own(holder, reveal.session, reveal.client, "revealed shares")
        asked = self._asked[holder]
        want = {**{o: SELF_SEED for o in asked.active}, **{o: MASK_SEED for o in asked.dropped}}
        got = {owner: kind for owner, kind, _ in reveal.records}
        if got != want:
            raise BadMessage(f"revealed shares of client {holder}: owners and kinds "
                             f"{sorted(got.items())[:5]} differ from those asked "
                             f"{sorted(want.items())[:5]}")
        for owner, kind, share in reveal.records:
            committed = self._commitments[(owner, holder)][0 if kind == SELF_SEED else 1]
            if crypto.commit_share(self.session, owner, holder, kind, share) != committed:
                raise BadMessage(f"revealed shares of client {holder}: its share of client "
                                 f"{owner}'s {'self-mask' if kind == SELF_SEED else 'mask key'} "
                                 f"seed is not the one committed")
        return list(reveal.records)

    def _rebuild(self, owner: int, kind: int,
                 good: Mapping[tuple[int, int], list[tuple[int, bytes]]]) -> bytes:
        """``owner``'s seed of ``kind`` from ``threshold`` good shares (ThresholdError when
        fewer arrived)."""
        shares = sorted(good.get((owner, kind), []))
        what = "self-mask seed" if kind == SELF_SEED else "mask key seed"
        if len(shares) < self.threshold:
            raise self._fail(f"session {self.session.hex()}: {len(shares)} good shares of "
                             f"client {owner}'s {what}, {self.threshold} needed (rejected: "
                             f"{sorted(self.rejected)[:8]})")
        seed = crypto.combine([s for _, s in shares[:self.threshold]])
        if seed is None or len(seed) != crypto.SEED_BYTES:
            raise self._dealer(owner, what)
        return seed

    def _dealer(self, owner: int, what: str) -> SecAggError:
        self.stage = "failed"
        return SecAggError(f"session {self.session.hex()}: client {owner} dealt shares that do "
                           f"not rebuild its committed {what}; the sum cannot be unmasked "
                           f"(run the round again without client {owner})")
