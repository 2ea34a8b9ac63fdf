"""One secure-aggregation session with every client in this process: the messages passed by
hand, dropouts where asked, each message's bytes and each side's CPU time recorded.

For tests, the benchmark (``bench/secagg.py``) and an in-process engine; a deployment carries
the same bytes in Flower Messages or over the phone bridge instead.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedgc.privacy.secagg.client import ClientHandler
from fedgc.privacy.secagg.cost import STAGES, StageBytes
from fedgc.privacy.secagg.errors import SecAggError
from fedgc.privacy.secagg.server import ServerSession

__all__ = ["LocalRun", "run_local"]


@dataclass
class LocalRun:
    """What :func:`run_local` saw: the sum (None when the session failed: ``error``), the
    session, each client's bytes per stage and the CPU seconds of the server and of all clients
    per stage."""

    total: np.ndarray | None
    session: ServerSession
    bytes: dict[int, dict[str, StageBytes]] = field(default_factory=dict)
    server_seconds: dict[str, float] = field(default_factory=dict)
    client_seconds: dict[str, float] = field(default_factory=dict)
    error: Exception | None = None


def run_local(vectors: Mapping[int, np.ndarray], modulus_bits: int, *,
              drop: Mapping[int, str] | None = None, neighbours: int | None = None,
              threshold: int | None = None, min_survivors: int | None = None,
              rng: random.Random | None = None,
              tamper: Callable[[str, int, bytes], bytes] | None = None) -> LocalRun:
    """A session over ``vectors`` (client id -> ring vector, all of one length).

    ``drop`` maps a client to the stage (one of :data:`STAGES`) whose request it receives but
    never answers. ``tamper(stage, client, reply)`` may replace a reply before the server reads
    it (a hostile client). A :class:`SecAggError` from the server ends the run with ``error``
    set; a client that refuses a request counts as dropped there. ``server_seconds[stage]``
    is the server's work that makes a stage's requests (``"result"``: the unmasking).
    """
    drop = dict(drop or {})
    ids = list(vectors)
    length = len(next(iter(vectors.values())))
    run = LocalRun(None, ServerSession(ids, length, modulus_bits, neighbours=neighbours,
                                       threshold=threshold, min_survivors=min_survivors,
                                       rng=rng))
    handlers = {c: ClientHandler(c, length) for c in ids}
    run.bytes = {c: {} for c in ids}
    steps = [run.session.share_keys, run.session.collect_masked_vectors, run.session.unmask,
             run.session.result]
    t = time.process_time()
    requests = run.session.setup()
    run.server_seconds[STAGES[0]] = time.process_time() - t
    for i, stage in enumerate(STAGES):
        replies: dict[int, bytes] = {}
        t = time.process_time()
        for client, request in requests.items():
            if drop.get(client) == stage:
                run.bytes[client][stage] = StageBytes(len(request), 0)
                continue
            try:
                reply = handlers[client].handle(request, vectors[client])
            except SecAggError:
                run.bytes[client][stage] = StageBytes(len(request), 0)
                continue
            if tamper is not None:
                reply = tamper(stage, client, reply)
            replies[client] = reply
            run.bytes[client][stage] = StageBytes(len(request), len(reply))
        run.client_seconds[stage] = time.process_time() - t
        t = time.process_time()
        try:
            out = steps[i](replies)
        except SecAggError as ex:
            run.error = ex
            return run
        finally:
            key = STAGES[i + 1] if i + 1 < len(STAGES) else "result"
            run.server_seconds[key] = run.server_seconds.get(key, 0.0) + time.process_time() - t
        if isinstance(out, np.ndarray):
            run.total = out
        else:
            requests = out
    return run
