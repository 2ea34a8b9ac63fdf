"""What colluding hostile clients know of a round's benign updates, learnt once a round and
shared through a file in the run's client state folder.

The colluding attacks (``alie``, ``ipm``, ``min_max``, ``min_sum``: :mod:`client.attacks`) craft
their update from benign updates. Their papers give the attacker either every benign update of the
round (full knowledge) or only the updates its own clients would honestly send (partial
knowledge, Shejwalkar and Houmansadr, NDSS 2021, section on threat models). fedgc gives them
neither through the server: no client, hostile or not, learns anything from the server beyond
its own train message. Instead the colluders compute what they know themselves, as an attacker
that controls those clients would:

``attack.knowledge = partial``
    the honest update of every hostile client (``attack.clients``), each trained from the
    round's global model on that client's own data with that client's round seed: exactly
    what it would have sent under a dense method;
``attack.knowledge = full``
    the honest update of every other client of the run, computed the same way from their data.
    That is a simulation's privilege (the attacker reads every client's partition), kept for
    studies; with all clients in every round it is exactly the round's benign updates, with
    fewer it also holds clients not sampled.

The first colluder of a round computes them and writes them to ``collusion.knowledge`` in the
run's client state folder (under a lock, ``collusion.lock``, so that colluders training at once
on Ray compute them once); the others read them. A record is used only for the round, model
version and global model (a digest of its bytes) it was computed for, and the keys it covers:
a stale one (an earlier round, a run overwritten in the same folder) is computed again. Each
file is listed in the folder's manifest before it is first created
(:func:`fedgc.ownership.note_written`). The cost: ``m`` (partial) or ``n - m`` (full) extra local
trainings a round, in the first colluder's process.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from client.attacks import Benign
from client.state import StateStoreError, decode_record, encode_record
from fedgc.files import atomic_write_bytes
from fedgc.ownership import note_written

__all__ = ["KNOWLEDGE_FILE", "LOCK_FILE", "CollusionStore", "known_keys", "model_digest"]

#: The file colluders share the round's benign updates through, in the client state folder.
KNOWLEDGE_FILE = "collusion.knowledge"
#: The file whose lock makes one colluder compute them while the others wait.
LOCK_FILE = "collusion.lock"

#: What computes client ``key``'s honest update of the round: (pseudo-gradient, examples).
HonestUpdate = Callable[[int], tuple[Mapping[str, torch.Tensor], int]]


def known_keys(knowledge: str, hostile: Iterable[int], num_clients: int) -> list[int]:
    """The clients whose honest updates colluders know: the hostile ones (``partial``) or every
    other one (``full``), sorted."""
    hostile = set(hostile)
    if knowledge == "partial":
        return sorted(hostile)
    if knowledge == "full":
        return [k for k in range(num_clients) if k not in hostile]
    raise ValueError(f"attack.knowledge must be partial or full, got {knowledge!r}")


def model_digest(model: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a model's tensor names and bytes: which global model a record answers."""
    h = hashlib.sha256()
    for name, t in model.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class CollusionStore:
    """The colluders' shared record in ``root`` (the run's client state folder)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def learn(self, tag: Mapping[str, object], keys: list[int],
              honest: HonestUpdate) -> Benign:
        """The benign updates of ``keys`` for the round ``tag`` names (its round, model version
        and :func:`model_digest`): read when a colluder already computed them, else computed
        with ``honest`` (one key after another) and written for the others."""
        want = {**tag, "keys": [int(k) for k in keys]}
        self.root.mkdir(parents=True, exist_ok=True)
        lock = self.root / LOCK_FILE
        if not lock.exists():
            note_written(self.root, LOCK_FILE)
        with open(lock, "ab") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
            known = self._read(want)
            if known is not None:
                return known
            updates, examples = [], []
            for key in keys:
                update, n = honest(key)
                updates.append({name: t.detach().cpu() for name, t in update.items()})
                examples.append(int(n))
            path = self.root / KNOWLEDGE_FILE
            if not path.exists():
                note_written(self.root, KNOWLEDGE_FILE)
            atomic_write_bytes(path, encode_record(
                {"tag": want, "updates": updates, "examples": examples}))
            return Benign(updates, examples)

    def _read(self, want: Mapping[str, object]) -> Benign | None:
        """The stored record's benign updates when it answers ``want``; None when there is none,
        it answers another round, or it is damaged (then it is computed again)."""
        try:
            data = bytearray((self.root / KNOWLEDGE_FILE).read_bytes())
            record = decode_record(data, str(self.root / KNOWLEDGE_FILE))
        except (FileNotFoundError, StateStoreError):
            return None
        if record.get("tag") != want:
            return None
        return Benign(record["updates"], record["examples"])
