"""What a protocol adds to a message on the wire and on the clock: a profile of named parts.

fedgc's payload travels inside a protocol: a Flower SuperNode pulls a message as one RPC per
object (``PullMessages``, ``PullObject`` each, ``ConfirmMessageReceived``) and pushes its reply
the same way, each RPC an HTTP request with Flower's signed head lines, in TLS records, in TCP
segments; a phone on fedgc's bridge fetches its task in one gRPC call and uploads in one stream.
A :class:`ProtocolModel` (a *profile*) says, for a message of ``content`` bytes in ``objects``
objects:

- the bytes on the wire each way: ``fixed + per_object * objects + (1 + per_byte) * content``
  the way the message goes, ``fixed + per_object * objects + per_byte_ack * content`` the other
  way (requests, responses and the acknowledgements of the content);
- the traffic of an idle node (a poll and a heartbeat, their bytes and intervals);
- a round's orchestration, as named parts (:data:`ORCHESTRATION_PARTS`):

  ``poll``
      the wait for the node's next poll: uniform over ``poll_interval_s`` (a Flower SuperNode
      polls every 3 s when idle, ``time.sleep(3)`` in ``flwr/supernode/start_client_internal.py``;
      0 for a held call: the bridge's long poll answers at once);
  ``round_trips``
      one link round trip (the client's own latency) per RPC beyond the transfer's own:
      ``rpcs_down_fixed + rpcs_per_object * objects`` to fetch, the same up;
  ``startup``
      an app's start-up on the path, per message (``clientapp_startup_s``: a SuperNode in
      subprocess isolation starts a ClientApp process for each message; 0 for a resident app);
  ``server``
      the server's own work in the round's path: with ``server_measured``, the aggregation and
      the downlink's encoding *as this run's server measured them* (its thread's CPU seconds, by
      :class:`simulations.netem.extension.NetemClock`), plus ``server_s`` fixed seconds.

The byte terms come from :mod:`simulations.wire` ledgers of real deployments
(``python -m simulations wire calibrate RUN_DIR ... --out FILE``, a least-squares fit per
direction over every message captured); ``protocols.json`` beside this module holds fedgc's
profiles, each with the source of its clock terms (``clock_source``). A user's own profile is a
JSON file of the same form (:func:`load_protocols`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from simulations.netem.errors import NetemError

#: The calibrated models shipped with fedgc (written by ``python -m simulations wire calibrate``).
PROTOCOLS_FILE = Path(__file__).with_name("protocols.json")
#: Largest ArrayChunk Flower cuts an Array into (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``).
FLOWER_CHUNK_BYTES = 5 * 1024 * 1024


class ProtocolError(NetemError):
    """A protocol model or its file is missing a field or holds a value out of range."""


@dataclass(frozen=True)
class Direction:
    """Bytes of one message phase in one direction: ``fixed + per_object * objects +
    per_content * content``."""

    fixed: float
    per_object: float
    per_content: float

    def bytes(self, content: int, objects: int) -> int:
        """Wire bytes for a message of ``content`` bytes in ``objects`` objects."""
        return max(0, round(self.fixed + self.per_object * objects + self.per_content * content))


@dataclass(frozen=True)
class ProtocolModel:
    """One profile: a protocol's wire costs and a round's orchestration (module docstring).

    ``down_*`` describe fetching a server message (the node's requests go up, the message comes
    down), ``up_*`` pushing a reply (it goes up, the server's answers come down). Bytes are
    IP bytes on the link; the byte terms' seconds are wall seconds of the calibration run.
    """

    name: str
    down_sent: Direction  # fetching a message: what goes down (the message)
    down_acks: Direction  # fetching a message: what goes up (requests, acknowledgements)
    up_sent: Direction  # pushing a reply: what goes up
    up_acks: Direction  # pushing a reply: what comes down
    rpcs_down_fixed: int  # RPCs to fetch a message besides those per object
    rpcs_up_fixed: int
    rpcs_per_object: int  # RPCs per Flower object each way (1: PullObject/PushObject; 0: bridge)
    poll_interval_s: float  # 0: the node does not poll (a held call instead)
    poll_bytes_up: float
    poll_bytes_down: float
    heartbeat_interval_s: float  # 0: none
    heartbeat_bytes_up: float
    heartbeat_bytes_down: float
    clientapp_startup_s: float  # an app's start-up per message (0: the app is resident)
    server_s: float  # fixed server seconds per round, besides the measured work
    server_measured: bool  # charge the server's work as measured in the run
    source: str = ""  # where the byte terms come from
    clock_source: str = ""  # where the clock terms come from (machine, date)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Direction):
                for part in ("fixed", "per_object", "per_content"):
                    _finite(f"{self.name}.{f.name}.{part}", getattr(value, part))
            elif f.name == "server_measured":
                if not isinstance(value, bool):
                    raise ProtocolError(f"{self.name}.server_measured must be true or false, "
                                        f"got {value!r}")
            elif f.name not in ("name", *_TEXT_FIELDS):
                if not _finite(f"{self.name}.{f.name}", value) >= 0:
                    raise ProtocolError(f"{self.name}.{f.name} must be >= 0, got {value!r}")

    def download(self, content: int, objects: int) -> tuple[int, int]:
        """(up, down) bytes to fetch a message of ``content`` bytes in ``objects`` objects."""
        return self.down_acks.bytes(content, objects), self.down_sent.bytes(content, objects)

    def upload(self, content: int, objects: int) -> tuple[int, int]:
        """(up, down) bytes to push a reply of ``content`` bytes in ``objects`` objects."""
        return self.up_sent.bytes(content, objects), self.up_acks.bytes(content, objects)

    def rpcs(self, direction: str, objects: int) -> int:
        """RPCs (round trips) to move a message of ``objects`` objects ``down`` or ``up``."""
        fixed = self.rpcs_down_fixed if direction == "down" else self.rpcs_up_fixed
        return fixed + self.rpcs_per_object * objects

    def idle_bytes(self, seconds: float) -> tuple[float, float]:
        """(up, down) bytes an online idle node sends and receives in ``seconds``."""
        up = down = 0.0
        for interval, b_up, b_down in ((self.poll_interval_s, self.poll_bytes_up,
                                        self.poll_bytes_down),
                                       (self.heartbeat_interval_s, self.heartbeat_bytes_up,
                                        self.heartbeat_bytes_down)):
            if interval > 0:
                up += b_up * seconds / interval
                down += b_down * seconds / interval
        return up, down

    def orchestration(self) -> str:
        """The profile's orchestration in words (the run's header and ``summary.json``)."""
        poll = (f"a poll every {self.poll_interval_s:.3g} s" if self.poll_interval_s > 0
                else "a held call (no poll wait)")
        startup = (f"an app start-up of {self.clientapp_startup_s:.3g} s per message"
                   if self.clientapp_startup_s > 0 else "a resident app")
        server = " + ".join(part for part in (
            "the server's measured work" if self.server_measured else "",
            f"{self.server_s:.3g} s" if self.server_s > 0 else "") if part) or "none"
        return (f"{poll}; RPCs {self.rpcs_down_fixed} down + {self.rpcs_up_fixed} up"
                f"{' + 1 per object' if self.rpcs_per_object else ''}, a round trip each; "
                f"{startup}; server time: {server}")

    def to_dict(self) -> dict[str, Any]:
        """The model as JSON-ready values."""
        return asdict(self)

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any], where: str) -> ProtocolModel:
        """A model from :meth:`to_dict`'s form (without ``name``); a missing, unknown or bad
        field names ``where`` (the file), the profile and the field."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"{where}: profile {name!r} must be an object of the fields "
                                f"{list(_REQUIRED)}, got {type(data).__name__}")
        missing = [f for f in _REQUIRED if f not in data]
        unknown = sorted(k for k in set(data) - set(_REQUIRED) - set(_TEXT_FIELDS)
                         if not k.startswith("_"))
        if missing or unknown:
            what = (f"lacks field {missing[0]!r}" if missing
                    else f"has unknown field {unknown[0]!r}")
            raise ProtocolError(f"{where}: profile {name!r} {what}; expected the fields "
                                f"{list(_REQUIRED)} (and optionally {list(_TEXT_FIELDS)})")
        values: dict[str, Any] = {"name": name}
        for f in _REQUIRED:
            raw, label = data[f], f"{where}: {name}.{f}"
            if f in _DIRECTIONS:
                if not isinstance(raw, Mapping) or set(raw) != {"fixed", "per_object",
                                                                "per_content"}:
                    raise ProtocolError(f"{label} must be an object of 'fixed', 'per_object' "
                                        f"and 'per_content' (numbers), got {raw!r}")
                values[f] = Direction(*(_finite(f"{label}.{k}", raw[k])
                                        for k in ("fixed", "per_object", "per_content")))
            elif f == "server_measured":
                if not isinstance(raw, bool):
                    raise ProtocolError(f"{label} must be true or false, got {raw!r}")
                values[f] = raw
            elif f in _COUNTS:
                if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
                    raise ProtocolError(f"{label} must be an integer >= 0, got {raw!r}")
                values[f] = raw
            else:
                value = _finite(label, raw)
                if value < 0:
                    raise ProtocolError(f"{label} must be a number >= 0, got {raw!r}")
                values[f] = value
        for f in _TEXT_FIELDS:
            values[f] = str(data.get(f, where if f == "source" else ""))
        return cls(**values)


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}")
    return float(value)


_DIRECTIONS = ("down_sent", "down_acks", "up_sent", "up_acks")
_COUNTS = ("rpcs_down_fixed", "rpcs_up_fixed", "rpcs_per_object")
_TEXT_FIELDS = ("source", "clock_source")
#: Every field a profile in a JSON file must give (``source`` and ``clock_source`` optional).
_REQUIRED = tuple(f.name for f in fields(ProtocolModel) if f.name not in ("name", *_TEXT_FIELDS))
#: The named parts of a round's orchestration (module docstring), as ``rounds.csv`` splits it.
ORCHESTRATION_PARTS = ("poll", "round_trips", "startup", "server")


def load_protocols(path: str | Path = PROTOCOLS_FILE) -> dict[str, ProtocolModel]:
    """The profiles of a JSON file: an object of profile name -> fields (keys starting with
    ``_`` are comments).

    Raises
    ------
    ProtocolError
        One line naming the file (and the profile and field): a missing or unreadable file,
        text that is not a JSON object, a missing or unknown field, a negative, NaN or
        non-numeric value.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ProtocolError(f"{path}: cannot read the protocol profiles ({why})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ProtocolError(f"{path}: nests too deeply to be a file of protocol profiles") \
            from None
    except ValueError as err:
        raise ProtocolError(f"{path}: not a JSON object of protocol profiles ({err})") from None
    profiles = {k: v for k, v in data.items() if not k.startswith("_")} \
        if isinstance(data, dict) else {}
    if not profiles:
        raise ProtocolError(f"{path}: expected a JSON object of profile name -> fields (the "
                            f"form of simulations/netem/protocols.json), got "
                            f"{type(data).__name__ if not isinstance(data, dict) else 'none'}")
    return {name: ProtocolModel.from_dict(name, spec, str(path))
            for name, spec in profiles.items()}


def _refuse_constant(name: str) -> float:
    # JSON has no NaN or Infinity; Python's parser accepts them unless told not to.
    raise ValueError(f"{name} is not a number JSON allows")


def message_objects(arrays: Iterable[int], records: int) -> int:
    """Flower objects of a message: itself, its RecordDict, each record, and each Array with its
    ArrayChunks (an Array of ``n`` bytes is ``ceil(n / 5 MiB)`` chunks, at least one).

    ``arrays`` are the byte sizes of every Array of the message's ArrayRecords; ``records`` the
    number of its records of any kind.
    """
    return 2 + records + sum(1 + max(1, math.ceil(n / FLOWER_CHUNK_BYTES)) for n in arrays)


# ---- calibration ----------------------------------------------------------------------------


#: Per content byte when the runs do not span enough sizes to fit it: the TCP/IP headers of
#: full 1500-byte segments (52 of 1500 bytes) and a TLS record's 22 bytes per 16 KiB, the way
#: the content goes; one 52-byte acknowledgement per two segments the other way.
PER_CONTENT_SENT = 1500 / 1448 + 22 / 16384
PER_CONTENT_ACKS = 52 / (2 * 1448)


def _fit(rows: Sequence[tuple[float, float, float]], per_content: float) -> Direction:
    """Least squares ``y = fixed + per_object * objects + per_content * content`` over
    ``(objects, content, y)``. Objects are left out when they do not vary; the content term is
    fitted only over runs whose contents span at least a factor 2 (dense and compressed runs),
    else ``per_content`` is taken as given."""
    x = np.array([[1.0, o, c] for o, c, _ in rows])
    y = np.array([r[2] for r in rows])
    contents = x[:, 2]
    fit_content = contents.min() > 0 and contents.max() >= 2 * contents.min()
    if not fit_content:
        y = y - per_content * contents
    keep = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0 and (j == 1 or fit_content)]
    coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
    full = {0: 0.0, 1: 0.0, 2: per_content}
    full.update(zip(keep, (float(c) for c in coef), strict=True))
    return Direction(full[0], full[1], full[2])


def calibrate(name: str, ledgers: Sequence[Mapping[str, Any]],
              rounds: Sequence[Mapping[str, Any]] = ()) -> ProtocolModel:
    """Fit a protocol's model from wire ledgers (``wire.json``) of runs of that protocol.

    ``rounds`` are per-round timings (``simulations.wire.timing.round_split`` rows) for the
    clock terms; a node's first round (first contact: the app bundle, the identification
    query) is left out of them. Without rounds the start-up and server time are 0.
    """
    down_sent, down_acks, up_sent, up_acks = [], [], [], []
    rpcs_down, rpcs_up = [], []
    per_object = 1 if name.startswith("supernode") else 0  # a PullObject/PushObject per object
    for ledger in ledgers:
        for m in ledger.get("messages", []):
            if m["kind"] == "train-down":
                c = m["content"]["down"]
                down_sent.append((m["objects"], c, m["bytes"]["down"]))
                down_acks.append((m["objects"], c, m["bytes"]["up"]))
                rpcs_down.append(m["rpcs"] - m["objects"] * per_object)
            elif m["kind"] == "train-up":
                c = m["content"]["up"]
                up_sent.append((m["objects"], c, m["bytes"]["up"]))
                up_acks.append((m["objects"], c, m["bytes"]["down"]))
                rpcs_up.append(m["rpcs"] - m["objects"] * per_object)
    if not down_sent or not up_sent:
        raise ProtocolError(f"calibrating {name!r}: the ledgers hold no train message in both "
                            f"directions")

    def idle(kind: str) -> tuple[float, float, float]:
        counts = [ledger["idle"][kind] for ledger in ledgers if ledger.get("idle", {}).get(kind)
                  and ledger["idle"][kind].get("interval_s")]
        if not counts:
            return 0.0, 0.0, 0.0
        interval = float(np.median([c["interval_s"] for c in counts]))
        each = [sum(c["bytes_each"][d].values()) for c in counts for d in ("up", "down")]
        return (interval, float(np.mean(each[0::2])), float(np.mean(each[1::2])))

    poll, heartbeat = idle("poll"), idle("heartbeat")
    later = [r for r in rounds if r["round"] > 1 and r.get("startup_s") is not None]
    startup = [r["startup_s"] for r in later]
    # What is left of a round's orchestration once the message's wait for a poll (half an
    # interval on average) and the ClientApp's start-up are taken out: the server's work.
    server = [max(0.0, r["orchestration_s"] - r["startup_s"] - poll[0] / 2) for r in later]
    return ProtocolModel(
        name=name, down_sent=_fit(down_sent, PER_CONTENT_SENT),
        down_acks=_fit(down_acks, PER_CONTENT_ACKS), up_sent=_fit(up_sent, PER_CONTENT_SENT),
        up_acks=_fit(up_acks, PER_CONTENT_ACKS),
        rpcs_down_fixed=round(float(np.median(rpcs_down))),
        rpcs_up_fixed=round(float(np.median(rpcs_up))), rpcs_per_object=per_object,
        poll_interval_s=poll[0], poll_bytes_up=poll[1], poll_bytes_down=poll[2],
        heartbeat_interval_s=heartbeat[0], heartbeat_bytes_up=heartbeat[1],
        heartbeat_bytes_down=heartbeat[2],
        clientapp_startup_s=float(np.median(startup)) if startup else 0.0,
        server_s=float(np.median(server)) if server else 0.0,
        # The fitted server time is the calibration run's wall time (its evaluation and the
        # machine's load included): charged as it is, not measured again.
        server_measured=False,
        source=f"fit over {len(ledgers)} captured runs ({len(down_sent)} messages down, "
               f"{len(up_sent)} up)",
        clock_source=f"fit over {len(later)} captured rounds after the first (wall seconds of "
                     f"the machine that ran them)" if later else "")
