"""What a protocol adds to a message on the wire and on the clock, calibrated from captures.

fedgc's payload travels inside a protocol: a Flower SuperNode pulls a message as one RPC per
object (``PullMessages``, ``PullObject`` each, ``ConfirmMessageReceived``) and pushes its reply
the same way, each RPC an HTTP request with Flower's signed head lines, in TLS records, in TCP
segments; a phone on fedgc's bridge fetches its task in one gRPC call and uploads in one stream.
A :class:`ProtocolModel` says, for a message of ``content`` bytes in ``objects`` objects:

- the bytes on the wire each way: ``fixed + per_object * objects + (1 + per_byte) * content``
  the way the message goes, ``fixed + per_object * objects + per_byte_ack * content`` the other
  way (requests, responses and the acknowledgements of the content);
- the round trips it takes (one per RPC), which the emulator adds to the transfer's one;
- the traffic of an idle node (a poll and a heartbeat, their bytes and intervals), and the time
  between a message being ready and the node starting on it (half a poll interval on average,
  plus a ClientApp's start-up), and the server's own time between rounds.

The numbers come from :mod:`simulations.wire` ledgers of real deployments
(``python -m simulations wire calibrate RUN_DIR ... --out FILE``, a least-squares fit per
direction over every message captured); ``protocols.json`` beside this module holds fedgc's.
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
    """One protocol's wire and clock costs (see the module docstring).

    ``down_*`` describe fetching a server message (the node's requests go up, the message comes
    down), ``up_*`` pushing a reply (it goes up, the server's answers come down). Bytes are
    IP bytes on the link; seconds are wall seconds of the calibration run.
    """

    name: str
    down_sent: Direction  # fetching a message: what goes down (the message)
    down_acks: Direction  # fetching a message: what goes up (requests, acknowledgements)
    up_sent: Direction  # pushing a reply: what goes up
    up_acks: Direction  # pushing a reply: what comes down
    rpcs_down_fixed: int  # RPCs to fetch a message besides one per object
    rpcs_up_fixed: int
    poll_interval_s: float  # 0: the node does not poll (a held call instead)
    poll_bytes_up: float
    poll_bytes_down: float
    heartbeat_interval_s: float  # 0: none
    heartbeat_bytes_up: float
    heartbeat_bytes_down: float
    clientapp_startup_s: float
    server_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Direction):
                for part in ("fixed", "per_object", "per_content"):
                    _finite(f"{self.name}.{f.name}.{part}", getattr(value, part))
            elif f.name not in ("name", "source"):
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
        per_object = objects if self.name.startswith("supernode") else 0
        return fixed + per_object

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

    def to_dict(self) -> dict[str, Any]:
        """The model as JSON-ready values."""
        return asdict(self)

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any], where: str) -> ProtocolModel:
        """A model from :meth:`to_dict`'s form; a missing or bad field names ``where``."""
        values: dict[str, Any] = {"name": name}
        try:
            for f in fields(cls):
                if f.name == "name":
                    continue
                if f.name == "source":
                    values["source"] = str(data.get("source", where))
                    continue
                raw = data[f.name]
                if f.type in ("Direction", Direction):
                    values[f.name] = Direction(*(float(raw[k]) for k in
                                                 ("fixed", "per_object", "per_content")))
                else:
                    values[f.name] = int(raw) if f.type in ("int", int) else float(raw)
        except KeyError as err:
            raise ProtocolError(f"{where}: protocol {name!r} lacks field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"{where}: protocol {name!r} has a malformed field "
                                f"({err})") from None
        return cls(**values)


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def load_protocols(path: Path = PROTOCOLS_FILE) -> dict[str, ProtocolModel]:
    """The protocol models of a JSON file (``{name: model}``).

    Raises
    ------
    ProtocolError
        The file cannot be read, is not a JSON object, or a model is incomplete or out of range.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ProtocolError(f"{path}: cannot read the protocol models ({err.strerror})") from None
    except ValueError as err:
        raise ProtocolError(f"{path}: not a JSON object of protocol models ({err})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{path}: expected a JSON object of protocol name -> model")
    return {name: ProtocolModel.from_dict(name, spec, str(path))
            for name, spec in data.items() if not name.startswith("_")}


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
    for ledger in ledgers:
        for m in ledger.get("messages", []):
            if m["kind"] == "train-down":
                c = m["content"]["down"]
                down_sent.append((m["objects"], c, m["bytes"]["down"]))
                down_acks.append((m["objects"], c, m["bytes"]["up"]))
                rpcs_down.append(m["rpcs"] - (m["objects"] if name.startswith("supernode")
                                              else 0))
            elif m["kind"] == "train-up":
                c = m["content"]["up"]
                up_sent.append((m["objects"], c, m["bytes"]["up"]))
                up_acks.append((m["objects"], c, m["bytes"]["down"]))
                rpcs_up.append(m["rpcs"] - (m["objects"] if name.startswith("supernode")
                                            else 0))
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
        rpcs_up_fixed=round(float(np.median(rpcs_up))),
        poll_interval_s=poll[0], poll_bytes_up=poll[1], poll_bytes_down=poll[2],
        heartbeat_interval_s=heartbeat[0], heartbeat_bytes_up=heartbeat[1],
        heartbeat_bytes_down=heartbeat[2],
        clientapp_startup_s=float(np.median(startup)) if startup else 0.0,
        server_s=float(np.median(server)) if server else 0.0,
        source=f"fit over {len(ledgers)} captured runs ({len(down_sent)} messages down, "
               f"{len(up_sent)} up)")
