"""The cryptographic building blocks of secure aggregation, each taken from a maintained library.

Nothing here is a primitive of fedgc's own; this module only fixes which primitive does what,
with which lengths and labels:

- **Key agreement**: X25519 (``cryptography``), every key pair derived from a 16-byte seed with
  HKDF-SHA256, so that the seed (not a 32-byte scalar) is what gets secret-shared; 128-bit
  seeds match X25519's ~128-bit security. Flower's SecAgg+ uses ECDH on P-384 with PEM keys
  (~215 bytes each); raw X25519 keys are 32 bytes.
- **Key derivation**: HKDF-SHA256 (``cryptography``), salted with the session's id and labelled
  with what the key is for and by whom (``info``), so that no key serves two purposes or two
  sessions.
- **Authenticated encryption** of the shares one client sends another through the server:
  AES-256-GCM (``cryptography``) with a random 96-bit nonce and associated data binding the
  session, sender and receiver, so that a ciphertext replayed from another session, or
  forwarded to another client, fails authentication. (Flower's SecAgg+ uses Fernet, which has
  no associated data and costs a base64 expansion.)
- **Masks**: the ChaCha20 keystream (``cryptography``) of a 32-byte key as a pseudo-random
  generator, read as uint64 words modulo ``2^b`` (uniform: ``2^b`` divides ``2^64``). Each key
  expands once, so the fixed nonce is never reused with it. (Flower's ``pseudo_rand_gen`` folds
  its seed to 32 bits for NumPy's Mersenne Twister: a server could search all 2^32 seeds.)
- **Secret sharing**: Shamir over GF(2^128), Flower's ``create_shares`` / ``combine_shares``
  (pycryptodome underneath): a 16-byte secret becomes 36-byte shares (a 4-byte index and two
  16-byte chunks: Flower pads to a whole extra block).
- **Commitments**: SHA-256 (``cryptography``) of a labelled message, truncated to 16 bytes for a
  share (128-bit second-preimage resistance: a client cannot forge another share that passes);
  the self-mask seed's commitment keeps all 32. Committed values are uniformly random 128-bit
  strings, so their hashes reveal nothing of them.

Randomness is the operating system's CSPRNG (``os.urandom``, as ``cryptography`` itself uses).
"""

from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from fedgc.privacy.secagg.errors import BadMessage

__all__ = ["CIPHERTEXT_BYTES", "COMMITMENT_BYTES", "KEY_BYTES", "PLAINTEXT_BYTES", "SEED_BYTES",
           "SESSION_BYTES", "SHARE_BYTES", "SeedCommitment", "agree", "check_public", "commit_seed",
           "commit_share", "combine", "key_pair", "mask", "new_seed", "open_shares",
           "public_bytes", "seal_shares", "self_mask_key", "share"]

#: A secret seed (self-mask seed, key-pair seed).
SEED_BYTES = 16
#: A raw X25519 public key.
KEY_BYTES = 32
#: A session's id.
SESSION_BYTES = 16
#: One Shamir share of a 16-byte seed from Flower's create_shares: index u32 + two 16-byte chunks.
SHARE_BYTES = 4 + 32
#: What one client sends another: its share of the self-mask seed, then of the mask key's seed.
PLAINTEXT_BYTES = 2 * SHARE_BYTES
_NONCE_BYTES = 12
_TAG_BYTES = 16
#: nonce | AES-GCM ciphertext of the plaintext | tag.
CIPHERTEXT_BYTES = _NONCE_BYTES + PLAINTEXT_BYTES + _TAG_BYTES
#: A share's commitment (SHA-256 truncated).
COMMITMENT_BYTES = 16
#: The self-mask seed's commitment (SHA-256).
SeedCommitment = bytes
_IDS = struct.Struct("<QQ")


def new_seed() -> bytes:
    """A fresh secret seed from the OS's CSPRNG."""
    return os.urandom(SEED_BYTES)


def _hkdf(material: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(material)


def key_pair(seed: bytes) -> X25519PrivateKey:
    """The X25519 private key of a 16-byte ``seed`` (HKDF-SHA256, labelled)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a key-pair seed is {SEED_BYTES} bytes, got {len(seed)}")
    return X25519PrivateKey.from_private_bytes(_hkdf(seed, b"", b"fedgc secagg x25519 key"))


def public_bytes(private: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``private``."""
    return private.public_key().public_bytes_raw()


def check_public(public: bytes, owner: int) -> None:
    """BadMessage unless ``public`` is a usable X25519 public key: a low-order point makes every
    exchange with it fail (``cryptography`` refuses its all-zero secret), so a client that sent
    one would make all its neighbours refuse the session."""
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(bytes(public)))
    except ValueError as ex:
        raise BadMessage(f"public key {bytes(public).hex()[:16]}... of client {owner} is not a "
                         f"usable X25519 key: {ex}") from ex


def agree(private: X25519PrivateKey, public: bytes, session: bytes, purpose: bytes,
          a: int, b: int) -> bytes:
    """The 32-byte key clients ``a`` and ``b`` share for ``purpose`` in ``session``: X25519 of
    one's private key and the other's public key, through HKDF (salt: the session; info: the
    purpose and the two ids in increasing order, so both ends derive the same).

    BadMessage for a public key that is not a usable X25519 point (a low-order point gives an
    all-zero secret, which ``cryptography`` refuses)."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(public)))
    except ValueError as ex:
        raise BadMessage(f"public key {bytes(public).hex()[:16]}... of client "
                         f"{b if a < b else a} is not a usable X25519 key: {ex}") from ex
    lo, hi = sorted((a, b))
    return _hkdf(shared, session, b"fedgc secagg " + purpose + _IDS.pack(lo, hi))


def self_mask_key(seed: bytes, session: bytes, client: int) -> bytes:
    """The 32-byte key of ``client``'s self mask from its 16-byte seed."""
    return _hkdf(seed, session, b"fedgc secagg self mask" + _IDS.pack(client, 0))


def mask(key: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` uniform uint64 values modulo ``2^bits``: the ChaCha20 keystream of ``key``."""
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * length)), dtype="<u8")
    return words & np.uint64((1 << bits) - 1)


def _aad(session: bytes, source: int, target: int) -> bytes:
    return b"fedgc secagg shares" + session + _IDS.pack(source, target)


def seal_shares(key: bytes, session: bytes, source: int, target: int, plaintext: bytes) -> bytes:
    """AES-256-GCM of ``plaintext`` (``source``'s shares for ``target``), bound to the session
    and both ids: nonce | ciphertext | tag, :data:`CIPHERTEXT_BYTES` long."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(session, source, target))


def open_shares(key: bytes, session: bytes, source: int, target: int, ciphertext: bytes) -> bytes:
    """The plaintext of :func:`seal_shares`; BadMessage when it does not authenticate (altered,
    from another session, or meant for another pair of clients)."""
    if len(ciphertext) != CIPHERTEXT_BYTES:
        raise BadMessage(f"the shares from client {source} are {len(ciphertext)} bytes, "
                         f"expected {CIPHERTEXT_BYTES}")
    nonce, body = bytes(ciphertext[:_NONCE_BYTES]), bytes(ciphertext[_NONCE_BYTES:])
    try:
        return AESGCM(key).decrypt(nonce, body, _aad(session, source, target))
    except InvalidTag:
        raise BadMessage(f"the shares from client {source} to client {target} do not "
                         f"authenticate: altered, replayed from another session or meant for "
                         f"another client") from None


def _sha256(*parts: bytes) -> bytes:
    h = hashes.Hash(hashes.SHA256())
    for p in parts:
        h.update(struct.pack("<I", len(p)))  # length-prefixed: no two part lists collide
        h.update(p)
    return h.finalize()


def commit_share(session: bytes, owner: int, holder: int, kind: int, share_bytes: bytes) -> bytes:
    """The 16-byte commitment to ``owner``'s share of kind ``kind`` held by ``holder``."""
    return _sha256(b"fedgc secagg share", session, _IDS.pack(owner, holder), bytes([kind]),
                   share_bytes)[:COMMITMENT_BYTES]


def commit_seed(session: bytes, owner: int, seed: bytes) -> bytes:
    """The 32-byte commitment to ``owner``'s self-mask seed."""
    return _sha256(b"fedgc secagg self seed", session, _IDS.pack(owner, 0), seed)


def share(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` Shamir shares of a 16-byte ``secret``, any ``threshold`` of which rebuild it
    (Flower's ``create_shares``)."""
    if len(secret) != SEED_BYTES:
        raise ValueError(f"a shared secret is {SEED_BYTES} bytes, got {len(secret)}")
    return create_shares(secret, threshold, count)


def combine(shares: list[bytes]) -> bytes | None:
    """The secret of ``shares`` (Flower's ``combine_shares``), or None when they do not combine
    (too few, or inconsistent: its padding check fails; a wrong secret that passes it is caught
    by the caller's commitment check)."""
    try:
        return combine_shares(shares)
    except ValueError:
        return None
