"""The virtual clock of one round: when each client finishes, and which updates make the round.

A sampled client downloads the server's message, trains, and uploads its reply, each step on its
own link and device in virtual time. :class:`RoundClock` closes the round with the first K
finishers within the deadline (the server over-selects, e.g. 1.3x, to absorb stragglers); the
others are dropped and counted by cause.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from simulations.netem._validate import integer, number
from simulations.netem.device import Device
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import REASON_LINK_DOWN, Link, TransferResult

REASON_UNAVAILABLE = "unavailable"
REASON_DEADLINE = "deadline"  # finished (or failed) after the round had closed
REASON_STRAGGLER = "straggler"  # finished in time, but after the K-th finisher closed the round


@dataclass(frozen=True)
class ClientJob:
    """What one sampled client has to do in a round.

    Attributes
    ----------
    client_id : int
        The client.
    download_bytes : int
        Exact encoded size of the server's message.
    upload_bytes : int
        Exact encoded size of the client's reply.
    compute_s : float
        Virtual training time (e.g. ``Device.compute_seconds``).
    """

    client_id: int
    download_bytes: int
    upload_bytes: int
    compute_s: float

    def __post_init__(self) -> None:
        integer("ClientJob", "client_id", self.client_id, minimum=0)
        integer("ClientJob", "download_bytes", self.download_bytes, minimum=0)
        integer("ClientJob", "upload_bytes", self.upload_bytes, minimum=0)
        number("ClientJob", "compute_s", self.compute_s, minimum=0.0)


@dataclass(frozen=True)
class ClientTimeline:
    """One client's round on the virtual clock, before the round is closed.

    ``finish_s`` is when its reply arrived (``ok``) or when it failed (``reason``).
    """

    client_id: int
    ok: bool
    reason: str
    finish_s: float
    download: TransferResult | None
    compute_s: float
    upload: TransferResult | None


def client_timeline(link: Link, device: Device, job: ClientJob, start_s: float,
                    round_index: int) -> ClientTimeline:
    """Play one client's download, training and upload from ``start_s``."""
    if not device.is_available(round_index):
        return ClientTimeline(job.client_id, False, REASON_UNAVAILABLE, start_s, None, 0.0, None)
    down = link.transfer(job.download_bytes, start_s, "down", round_index=round_index)
    if not down.ok:
        return ClientTimeline(job.client_id, False, down.reason, down.end_s, down, 0.0, None)
    up = link.transfer(job.upload_bytes, down.end_s + job.compute_s, "up",
                       round_index=round_index)
    return ClientTimeline(job.client_id, up.ok, up.reason, up.end_s, down, job.compute_s, up)


@dataclass(frozen=True)
class RoundOutcome:
    """A closed round.

    Attributes
    ----------
    round_index : int
        The round.
    start_s, end_s : float
        Virtual times the round started and closed.
    aggregated : tuple of int
        Client ids whose updates made the round, in finishing order.
    dropped : dict of int to str
        Client id -> why its update did not make it (``link_down``, ``unavailable``,
        ``deadline``, ``straggler``).
    timelines : tuple of ClientTimeline
        Every sampled client's timeline.
    """

    round_index: int
    start_s: float
    end_s: float
    aggregated: tuple[int, ...]
    dropped: dict[int, str]
    timelines: tuple[ClientTimeline, ...]

    @property
    def virtual_seconds(self) -> float:
        """The round's emulated duration."""
        return self.end_s - self.start_s

    @property
    def dropped_deadline(self) -> int:
        """Updates that arrived too late: past the deadline, or after the round closed short
        of K at its deadline."""
        return sum(r == REASON_DEADLINE for r in self.dropped.values())

    @property
    def surplus(self) -> int:
        """Updates that arrived in time, after the K-th had closed the round: over-selection
        doing its job, not a failure."""
        return sum(r == REASON_STRAGGLER for r in self.dropped.values())

    @property
    def dropped_link(self) -> int:
        """Clients lost to the network before the round closed (outage, unreachable device)."""
        return sum(r in (REASON_LINK_DOWN, REASON_UNAVAILABLE) for r in self.dropped.values())

    def reasons(self) -> Counter[str]:
        """Drop counts by exact reason."""
        return Counter(self.dropped.values())


class RoundClock:
    """Closes rounds by deadline and first-K finishers.

    Parameters
    ----------
    clients_per_round : int
        K, the updates wanted per round, >= 1.
    deadline_s : float
        The round's deadline in virtual seconds after its start, > 0 (``math.inf``: none).
    over_selection : float
        Clients sampled per wanted update, >= 1 (1.3 is the usual straggler defence).
    """

    def __init__(self, clients_per_round: int, deadline_s: float = math.inf,
                 over_selection: float = 1.0) -> None:
        self.clients_per_round = integer("RoundClock", "clients_per_round", clients_per_round,
                                         minimum=1)
        if not (isinstance(deadline_s, (int, float)) and not isinstance(deadline_s, bool)
                and deadline_s > 0 and not math.isnan(deadline_s)):
            raise LinkConfigError(f"RoundClock.deadline_s must be > 0 seconds (or math.inf), "
                                  f"got {deadline_s!r}")
        self.deadline_s = float(deadline_s)
        self.over_selection = number("RoundClock", "over_selection", over_selection, minimum=1.0)

    def num_to_sample(self, available: int) -> int:
        """How many clients to sample when ``available`` are available."""
        integer("RoundClock", "available", available, minimum=0)
        # The epsilon keeps 10 * 1.3 at 13, not 14 after floating-point rounding.
        wanted = math.ceil(self.clients_per_round * self.over_selection - 1e-9)
        return min(available, wanted)

    def close(self, round_index: int, start_s: float,
              timelines: Iterable[ClientTimeline]) -> RoundOutcome:
        """Pick the first K finishers within the deadline and close the round."""
        tls = tuple(timelines)
        deadline_at = start_s + self.deadline_s
        # Ties are broken by client id so the outcome does not depend on the order given.
        finished = sorted((t for t in tls if t.ok and t.finish_s <= deadline_at),
                          key=lambda t: (t.finish_s, t.client_id))
        accepted = finished[: self.clients_per_round]
        if len(accepted) == self.clients_per_round:
            end_s = accepted[-1].finish_s
        elif math.isfinite(deadline_at):
            # The server cannot tell a lost client from a slow one: it waits for the deadline.
            end_s = deadline_at
        else:
            end_s = max((t.finish_s for t in tls), default=start_s)
        ids = {t.client_id for t in accepted}
        dropped: dict[int, str] = {}
        for t in tls:
            if t.client_id in ids:
                continue
            if t.finish_s <= end_s and not t.ok:
                dropped[t.client_id] = t.reason
            elif t.ok and t.finish_s <= deadline_at:
                dropped[t.client_id] = REASON_STRAGGLER  # in time, but K had already arrived
            else:
                dropped[t.client_id] = REASON_DEADLINE
        return RoundOutcome(round_index, start_s, end_s, tuple(t.client_id for t in accepted),
                            dropped, tls)

    def run(self, round_index: int, start_s: float, jobs: Iterable[ClientJob],
            network: object) -> RoundOutcome:
        """Play every job on its client's link and device (``network[client_id]`` gives them)."""
        tls = []
        for job in jobs:
            cn = network[job.client_id]  # an Assignment, or any mapping to ClientNetwork
            tls.append(client_timeline(cn.link, cn.device, job, start_s, round_index))
        ids = [t.client_id for t in tls]
        if len(set(ids)) != len(ids):
            twice = sorted(i for i in set(ids) if ids.count(i) > 1)
            raise LinkConfigError(f"RoundClock.run got the same client twice in round "
                                  f"{round_index}: {twice}")
        return self.close(round_index, start_s, tls)
