"""Seeded partitioners that split a labelled training set across federated clients."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tasks.errors import DataError

#: Schemes :func:`partition` implements from labels alone. ``"natural"`` needs a dataset's own
#: client split and is served by :meth:`tasks.Task.partition`.
LABEL_SCHEMES = ("iid", "dirichlet", "shards")
SCHEMES = ("natural",) + LABEL_SCHEMES


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be a 1-D array of class ids, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integer class ids, got dtype {labels.dtype}")
    return labels


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise DataError(f"num_clients must be an int >= 1, got {num_clients!r}")
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > num_samples:
        # Every client must hold at least one sample; more clients than samples cannot satisfy it.
        raise DataError(
            f"num_clients={num_clients} exceeds the {num_samples} samples to partition; "
            "every client needs at least one sample"
        )


def _iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(num_samples), num_clients)


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    # Per-class proportions over clients drawn from Dir(alpha) (Hsu et al. 2019): small alpha puts
    # most of a class on few clients.
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        cuts = np.round(np.cumsum(proportions)[:-1] * members.size).astype(np.int64)
        for client, chunk in enumerate(np.split(members, cuts)):
            buckets[client].append(chunk)
    parts = [np.concatenate(b) if b else np.empty(0, np.int64) for b in buckets]
    # Small alpha can leave a client with nothing; give each empty client one sample taken from the
    # currently largest client so every index is still assigned exactly once. Deterministic.
    for client in range(num_clients):
        if parts[client].size == 0:
            donor = int(np.argmax([p.size for p in parts]))
            parts[client] = parts[donor][-1:]
            parts[donor] = parts[donor][:-1]
    return parts


def _shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    num_shards = num_clients * shards_per_client
    if num_shards > labels.size:
        raise DataError(
            f"shards scheme needs num_clients*shards_per_client = {num_clients}*"
            f"{shards_per_client} = {num_shards} <= {labels.size} samples"
        )
    # Shuffle first so that ties within a label are broken by the seed, then sort stably by label
    # (McMahan et al. 2017): each shard is (mostly) a single class.
    shuffled = rng.permutation(labels.size)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shards = np.array_split(by_label, num_shards)
    order = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.concatenate([shards[s] for s in row]) for row in order]


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split sample indices across clients by a label-based scheme.

    Parameters
    ----------
    labels : np.ndarray
        1-D integer class ids of the training set; the returned indices point into it.
    num_clients : int
        Number of clients, ``1 <= num_clients <= len(labels)``. More clients than samples raises
        :class:`DataError`, since every client must receive at least one sample.
    scheme : str
        ``"iid"`` (uniform random, sizes differ by at most one), ``"dirichlet"`` (per-class
        proportions over clients from Dir(``alpha``); smaller alpha means stronger label skew) or
        ``"shards"`` (sort by label, cut into ``num_clients * shards_per_client`` shards, deal
        ``shards_per_client`` to each client). ``"natural"`` is only available through
        :meth:`tasks.Task.partition` for datasets with a natural client split.
    alpha : float
        Dirichlet concentration, finite and > 0; used by ``"dirichlet"`` only.
    shards_per_client : int
        Shards per client, >= 1; used by ``"shards"`` only.
    seed : int
        Seed of the partition; the same arguments give the same partition.

    Returns
    -------
    list[np.ndarray]
        One sorted int64 index array per client. Every index in ``range(len(labels))`` appears in
        exactly one client, and no client is empty.

    Raises
    ------
    DataError
        On an unknown scheme, bad ``num_clients``, ``alpha`` or ``shards_per_client``, or labels
        that are not a 1-D integer array.
    """
    labels = _check_labels(labels)
    if scheme == "natural":
        raise DataError(
            "scheme 'natural' needs a dataset's own client split; use Task.partition on a task "
            f"that has one; label-based schemes are {list(LABEL_SCHEMES)}"
        )
    if scheme not in LABEL_SCHEMES:
        raise DataError(f"unknown partition scheme {scheme!r}; expected one of {list(SCHEMES)}")
    _check_num_clients(num_clients, labels.size)
    num_clients = int(num_clients)
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = _iid(labels.size, num_clients, rng)
    elif scheme == "dirichlet":
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating)):
            raise DataError(f"alpha must be a float > 0, got {alpha!r}")
        if not np.isfinite(alpha) or alpha <= 0:
            raise DataError(f"alpha must be finite and > 0, got {alpha}")
        parts = _dirichlet(labels, num_clients, float(alpha), rng)
    else:
        if isinstance(shards_per_client, bool) or not isinstance(
            shards_per_client, (int, np.integer)
        ):
            raise DataError(f"shards_per_client must be an int >= 1, got {shards_per_client!r}")
        if shards_per_client < 1:
            raise DataError(f"shards_per_client must be >= 1, got {shards_per_client}")
        parts = _shards(labels, num_clients, int(shards_per_client), rng)
    return [np.sort(p).astype(np.int64) for p in parts]


def label_skew(labels: np.ndarray, parts: Sequence[np.ndarray]) -> float:
    """Mean total-variation distance between each client's label distribution and the global one.

    0 means every client sees the global class mix; values near 1 mean each client holds classes
    that are rare overall. Clients are weighted equally.
    """
    labels = _check_labels(labels)
    if len(parts) == 0:
        raise DataError("label_skew needs at least one client part, got none")
    classes, encoded = np.unique(labels, return_inverse=True)
    global_dist = np.bincount(encoded, minlength=classes.size) / labels.size
    distances = []
    for part in parts:
        if len(part) == 0:
            raise DataError("label_skew got an empty client part; every part needs >= 1 index")
        counts = np.bincount(encoded[np.asarray(part)], minlength=classes.size)
        distances.append(0.5 * np.abs(counts / counts.sum() - global_dist).sum())
    return float(np.mean(distances))
