"""The client half of secure aggregation: one handler per client and session, stage by stage.

A :class:`ClientHandler` answers the server's four requests (:mod:`fedgc.privacy.secagg.wire`)
in order, each with the bytes of its reply:

0. **setup**: check the session's parameters, draw three 16-byte seeds (the cipher key pair's,
   the mask key pair's and the self mask's) and reply with the two public keys.
1. **share keys**: given its neighbours' public keys, split the self-mask seed and the mask key's
   seed into Shamir shares (any ``threshold`` rebuild them), encrypt each neighbour's pair of
   shares to it (AES-GCM under a key agreed with it) and reply with the ciphertexts and
   commitments to each share and to the self-mask seed.
2. **masked vector**: given the ciphertexts its neighbours sent it, decrypt and keep their
   shares, and reply with ``y = x + PRG(self seed) + sum_v +-PRG(k_uv) mod 2^b``, ``k_uv`` the key
   agreed with each neighbour ``v`` whose shares arrived (``+`` when its id is below ``v``'s).
3. **unmask**: given which of those neighbours sent their vectors (``active``) and which did not
   (``dropped``), reveal its share of each active one's self-mask seed and of each dropped one's
   mask key seed, never both for one neighbour, and only once per session.

Every request is checked before anything changes (session, ids, counts, lengths,
authentication, the threshold): a bad one raises a :class:`SecAggError` subclass and leaves the
handler where it was. :meth:`state_dict` and :meth:`from_state` carry a handler between
processes (a ClientApp that runs one process per message); the seeds are in it, so that state
is as secret as the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgc.privacy.secagg import crypto
from fedgc.privacy.secagg.errors import BadMessage, SecAggError, StageError, ThresholdError
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

__all__ = ["ClientHandler", "check_setup"]

_STAGES = ("setup", "share_keys", "masked_vector", "unmask", "done")


def check_setup(setup: Setup, client: int, length: int | None = None) -> None:
    """BadMessage unless ``setup`` is a session this client can take part in safely: its own id,
    2 or more clients, 1 to ``clients - 1`` neighbours, a threshold that is a strict majority of
    them (a lower one would let a server that asks half the neighbours for one kind of share
    and half for the other rebuild both secrets of one client), a modulus of 1 to 62 bits and
    the vector length the client expects."""
    problems = []
    if setup.client != client:
        problems.append(f"it names client {setup.client}, this is client {client}")
    if setup.clients < 2:
        problems.append(f"clients = {setup.clients}, expected >= 2")
    if not 1 <= setup.neighbours <= setup.clients - 1:
        problems.append(f"neighbours = {setup.neighbours}, expected 1 to {setup.clients - 1}")
    if not setup.neighbours < 2 * setup.threshold <= 2 * setup.neighbours:
        problems.append(f"threshold = {setup.threshold} of {setup.neighbours} neighbours, "
                        f"expected a strict majority ({setup.neighbours // 2 + 1} to "
                        f"{setup.neighbours})")
    if not 1 <= setup.modulus_bits <= 62:
        problems.append(f"modulus_bits = {setup.modulus_bits}, expected 1 to 62")
    if setup.length < 1 or (length is not None and setup.length != length):
        problems.append(f"length = {setup.length}, expected "
                        f"{length if length is not None else '>= 1'}")
    if problems:
        raise BadMessage("setup request refused: " + "; ".join(problems))


class ClientHandler:
    """One client's side of one secure-aggregation session (module docstring).

    Parameters
    ----------
    client : int
        This client's id in the session (u64).
    length : int or None
        The vector length it will send, when known before the setup (the setup request must
        then agree).
    """

    def __init__(self, client: int, length: int | None = None) -> None:
        self.client = int(client)
        self.length = length
        self._reset()

    def _reset(self) -> None:
        self.stage = "setup"
        self.setup_request: Setup | None = None
        self._cipher_seed = b""
        self._mask_seed = b""
        self._self_seed = b""
        self.neighbour_keys: dict[int, tuple[bytes, bytes]] = {}
        #: Shares held for each neighbour whose ciphertext arrived: (self seed's, mask key's).
        self.held: dict[int, tuple[bytes, bytes]] = {}

    # ------------------------------------------------------------------ helpers
    def _expect(self, stage: str) -> Setup:
        if self.stage != stage or self.setup_request is None:
            raise StageError(f"client {self.client}: a {stage} request while the session "
                             f"expects {self.stage}")
        return self.setup_request

    def _session(self, setup: Setup, session: bytes, what: str) -> None:
        if session != setup.session:
            raise BadMessage(f"client {self.client}: {what} of session {session.hex()}, this "
                             f"session is {setup.session.hex()}")

    def handle(self, message: bytes, vector: np.ndarray | None = None) -> bytes:
        """The reply to ``message``, whichever stage it is (the vector is needed at stage 2)."""
        magic = bytes(message[:4])
        if magic == b"FGA0":
            return self.setup(message)
        if magic == b"FGA2":
            return self.share_keys(message)
        if magic == b"FGA4":
            if vector is None:
                raise SecAggError(f"client {self.client}: the masked-vector stage needs the "
                                  f"vector")
            return self.masked_vector(message, vector)
        if magic == b"FGA6":
            return self.unmask(message)
        raise BadMessage(f"client {self.client}: not a secure-aggregation request (magic "
                         f"{magic!r})")

    # ------------------------------------------------------------------ stage 0
    def setup(self, message: bytes) -> bytes:
        """Check the session's parameters; reply with the two public keys. A new session
        replaces one left unfinished (the server gave it up); the same session's setup again
        mid-way is refused (a replay would throw away the shares this client holds)."""
        setup = Setup.decode(message)
        current = self.setup_request
        if current is not None and self.stage != "done" and setup.session == current.session:
            raise StageError(f"client {self.client}: a second setup of session "
                             f"{setup.session.hex()} while it expects {self.stage}")
        check_setup(setup, self.client, self.length)
        self._reset()
        self.setup_request = setup
        self._cipher_seed, self._mask_seed, self._self_seed = (
            crypto.new_seed(), crypto.new_seed(), crypto.new_seed())
        self.stage = "share_keys"
        return Keys(setup.session, self.client,
                    crypto.public_bytes(crypto.key_pair(self._cipher_seed)),
                    crypto.public_bytes(crypto.key_pair(self._mask_seed))).encode()

    # ------------------------------------------------------------------ stage 1
    def share_keys(self, message: bytes) -> bytes:
        """Share the two seeds among the neighbours named; reply with the ciphertexts."""
        setup = self._expect("share_keys")
        request = Neighbours.decode(message)
        self._session(setup, request.session, "neighbours' keys")
        ids = [k[0] for k in request.keys]
        if len(ids) > setup.neighbours or self.client in ids:
            raise BadMessage(f"client {self.client}: {len(ids)} neighbours (its own id among "
                             f"them: {self.client in ids}); the session gives each at most "
                             f"{setup.neighbours}, never itself")
        if len(ids) < setup.threshold:
            raise ThresholdError(f"client {self.client}: {len(ids)} neighbours left, fewer than "
                                 f"the threshold {setup.threshold}: its seeds could not be "
                                 f"rebuilt")
        own = {crypto.public_bytes(crypto.key_pair(self._cipher_seed)),
               crypto.public_bytes(crypto.key_pair(self._mask_seed))}
        keys = [k for _, c, m in request.keys for k in (c, m)]
        if len(set(keys)) != len(keys) or own & set(keys):
            raise BadMessage(f"client {self.client}: two neighbours' public keys are equal, or "
                             f"equal to its own")
        cipher = crypto.key_pair(self._cipher_seed)
        self_shares = crypto.share(self._self_seed, setup.threshold, len(ids))
        mask_shares = crypto.share(self._mask_seed, setup.threshold, len(ids))
        records = []
        for (peer, cipher_key, _), s, m in zip(request.keys, self_shares, mask_shares,
                                               strict=True):
            key = crypto.agree(cipher, cipher_key, setup.session, b"shares", self.client, peer)
            records.append((peer,
                            crypto.commit_share(setup.session, self.client, peer, SELF_SEED, s),
                            crypto.commit_share(setup.session, self.client, peer, MASK_SEED, m),
                            crypto.seal_shares(key, setup.session, self.client, peer, s + m)))
        self.neighbour_keys = {peer: (c, m) for peer, c, m in request.keys}
        self.stage = "masked_vector"
        return Shares(setup.session, self.client,
                      crypto.commit_seed(setup.session, self.client, self._self_seed),
                      tuple(records)).encode()

    # ------------------------------------------------------------------ stage 2
    def masked_vector(self, message: bytes, vector: np.ndarray) -> bytes:
        """Keep the neighbours' shares; reply with ``vector`` (ring elements modulo
        ``2^modulus_bits``) under the self mask and the pairwise masks."""
        setup = self._expect("masked_vector")
        request = Forward.decode(message)
        self._session(setup, request.session, "forwarded shares")
        x = np.asarray(vector)
        modulus = 1 << setup.modulus_bits
        if x.shape != (setup.length,) or not np.issubdtype(x.dtype, np.integer):
            raise SecAggError(f"client {self.client}: the vector is {x.dtype} of shape "
                              f"{x.shape}, the session sums {setup.length} integers")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= modulus):
            raise SecAggError(f"client {self.client}: the vector holds values outside "
                              f"[0, 2^{setup.modulus_bits}) (encode it with "
                              f"fedgc.privacy.FixedPoint)")
        held: dict[int, tuple[bytes, bytes]] = {}
        cipher = crypto.key_pair(self._cipher_seed)
        for source, ciphertext in request.records:
            if source not in self.neighbour_keys:
                raise BadMessage(f"client {self.client}: forwarded shares from client {source}, "
                                 f"not one of its neighbours")
            key = crypto.agree(cipher, self.neighbour_keys[source][0], setup.session, b"shares",
                               self.client, source)
            plain = crypto.open_shares(key, setup.session, source, self.client, ciphertext)
            held[source] = (plain[:crypto.SHARE_BYTES], plain[crypto.SHARE_BYTES:])
        if len(held) < setup.threshold:
            raise ThresholdError(f"client {self.client}: shares from {len(held)} neighbours, "
                                 f"fewer than the threshold {setup.threshold}")
        bits, length = setup.modulus_bits, setup.length
        y = x.astype(np.uint64) + crypto.mask(
            crypto.self_mask_key(self._self_seed, setup.session, self.client), length, bits)
        own = crypto.key_pair(self._mask_seed)
        for peer in sorted(held):
            key = crypto.agree(own, self.neighbour_keys[peer][1], setup.session, b"mask",
                               self.client, peer)
            if self.client < peer:
                y += crypto.mask(key, length, bits)
            else:
                y -= crypto.mask(key, length, bits)
        self.held = held
        self.stage = "unmask"
        return Masked(setup.session, self.client, bits,
                      y & np.uint64(modulus - 1)).encode()

    # ------------------------------------------------------------------ stage 3
    def unmask(self, message: bytes) -> bytes:
        """Reveal the shares the unmasking needs: of each active neighbour's self-mask seed and
        each dropped one's mask key seed."""
        setup = self._expect("unmask")
        request = Survivors.decode(message)
        self._session(setup, request.session, "survivors")
        unknown = sorted(set(request.active + request.dropped) - set(self.held))
        if unknown:
            raise BadMessage(f"client {self.client}: asked for shares of {unknown[:5]}, whose "
                             f"shares it never received")
        if len(request.active) + 1 < setup.threshold:
            raise ThresholdError(f"client {self.client}: {len(request.active)} active "
                                 f"neighbours and itself, fewer than the threshold "
                                 f"{setup.threshold}: it reveals nothing")
        records = [(a, SELF_SEED, self.held[a][0]) for a in request.active]
        records += [(d, MASK_SEED, self.held[d][1]) for d in request.dropped]
        self.stage = "done"  # once per session: a second request could ask for the other kind
        return Reveal(setup.session, self.client, tuple(records)).encode()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the handler holds, as ints, bytes and lists of them (secret: the seeds)."""
        return {
            "client": self.client, "length": -1 if self.length is None else self.length,
            "stage": _STAGES.index(self.stage),
            "setup": b"" if self.setup_request is None else self.setup_request.encode(),
            "seeds": self._cipher_seed + self._mask_seed + self._self_seed,
            "neighbours": list(self.neighbour_keys),
            "neighbour_keys": [c + m for c, m in self.neighbour_keys.values()],
            "held": list(self.held), "held_shares": [s + m for s, m in self.held.values()],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ClientHandler:
        """A handler that goes on from :meth:`state_dict` (BadMessage for a state that does not
        read back)."""
        try:
            length = int(state["length"])
            handler = cls(int(state["client"]), None if length < 0 else length)
            handler.stage = _STAGES[int(state["stage"])]
            if state["setup"]:
                handler.setup_request = Setup.decode(state["setup"])
            seeds = bytes(state["seeds"])
            n = crypto.SEED_BYTES
            handler._cipher_seed, handler._mask_seed, handler._self_seed = (
                seeds[:n], seeds[n:2 * n], seeds[2 * n:])
            k = crypto.KEY_BYTES
            handler.neighbour_keys = {int(i): (bytes(b[:k]), bytes(b[k:])) for i, b in zip(
                state["neighbours"], state["neighbour_keys"], strict=True)}
            s = crypto.SHARE_BYTES
            handler.held = {int(i): (bytes(b[:s]), bytes(b[s:])) for i, b in zip(
                state["held"], state["held_shares"], strict=True)}
        except (KeyError, IndexError, TypeError, ValueError) as ex:
            raise BadMessage(f"a secure-aggregation client state that does not read back: "
                             f"{type(ex).__name__}: {ex}") from ex
        return handler
