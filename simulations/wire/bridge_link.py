"""A phone's link to the bridge, from its capture and the phone's own call log.

The phone bridge speaks gRPC (HTTP/2) over TLS 1.3 from gRPC's BoringSSL, whose secrets cannot
be logged from Python, so its records are not decrypted. What is known exactly instead:

- every record's header and length on the wire (the capture);
- the handshake: the records before each side's first application record (the client's first
  encrypted record is its Finished; the server's encrypted records captured before it carry
  its encrypted extensions, certificate, verify and Finished);
- an application record's plaintext is its length less 22 bytes (5 of header, 1 inner type,
  16 of AEAD tag: BoringSSL does not pad), so the HTTP/2 bytes of each direction are known;
- each RPC's protobuf messages, sized in the phone (:mod:`.phone_process`): fedgc's content,
  the payload among it, and gRPC's 5-byte prefix per message.

An RPC owns the records and packets captured while it was in flight (calls are made one at a
time); its HTTP/2 and gRPC framing is its plaintext less its messages. Without TLS the same
split is checked against the HTTP/2 frames themselves (:func:`http2_data_bytes`).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

from .errors import WireError
from .ledger import Attribution, Exchange, attribute
from .pcap import read_pcap
from .tcp import DOWN, UP, Connection, connections
from .tls import APPLICATION_DATA, TlsStream, looks_like_tls, split_records

#: TLS 1.3 bytes around an application record's plaintext: header, inner type, AEAD tag.
TLS13_RECORD_OVERHEAD = 5 + 1 + 16
#: gRPC's length prefix per message (compressed flag and 4-byte length).
GRPC_PREFIX = 5
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The phone's call log.

    Raises
    ------
    WireError
        Missing, not JSON, or a call without its fields.
    """
    try:
        data = json.loads(Path(path).read_text())
        calls = data["calls"]
        for call in calls:
            for key in ("method", "t_start", "t_end", "request_bytes", "response_bytes"):
                if key not in call:
                    raise KeyError(key)
    except OSError as err:
        raise WireError(f"{path}: cannot read the phone's call log ({err.strerror})") from None
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"{path}: field {err} missing or malformed; expected the call log of "
                        f"simulations.wire.phone_process") from None
    return sorted(calls, key=lambda c: c["t_start"])


def _kind(call: dict[str, Any], last_round: int | None) -> tuple[str, int | None]:
    method = call["method"]
    if method == "Register":
        return "setup", None
    if method == "FetchTask":
        if call.get("has_task"):
            return "train-down", int(call.get("server_round", 0))
        return "poll", None
    return "train-up", last_round


def _segment_times(conn: Connection, direction: int) -> tuple[list[int], list[float]]:
    starts, times = [], []
    for seg in conn.segments:
        if seg.direction == direction and seg.payload:
            starts.append(seg.new_start)
            times.append(seg.t)
    return starts, times


def _time_of(offset: int, index: tuple[list[int], list[float]]) -> float:
    i = bisect.bisect_right(index[0], offset) - 1
    return index[1][max(0, i)] if index[1] else 0.0


def _tls_streams(conn: Connection) -> tuple[TlsStream, TlsStream]:
    """Records of both directions with their plaintext ranges, without decrypting."""
    out = []
    client_finished_t = None
    index = [_segment_times(conn, d) for d in (UP, DOWN)]
    records_by_dir = [split_records(conn.streams[d]) for d in (UP, DOWN)]
    first_up = next((r for r in records_by_dir[UP][0] if r.outer_type == APPLICATION_DATA), None)
    if first_up is not None:
        client_finished_t = _time_of(first_up.start, index[UP])
    for d in (UP, DOWN):
        records, trailing = records_by_dir[d]
        plain = 0
        handshake_done = False
        for r in records:
            r.plain_start = r.plain_end = plain
            if r.outer_type != APPLICATION_DATA:
                continue
            t = _time_of(r.start, index[d])
            if d == UP and not handshake_done:
                handshake_done = True  # the client's Finished
                continue
            if d == DOWN and client_finished_t is not None and t <= client_finished_t:
                continue  # the server's encrypted handshake flight
            size = (r.end - r.start) - TLS13_RECORD_OVERHEAD
            plain += max(0, size)
            r.plain_end = plain
        out.append(TlsStream(records, b"", trailing))
    return out[0], out[1]


def _owners(conn: Connection, calls: list[dict[str, Any]], exchanges: list[Exchange],
            units: list[list[tuple[int, int, float]]]) -> None:
    """Give each unit (plaintext range with its time) to the call in flight, and set the
    exchanges' plaintext spans from them (calls are sequential, so spans are contiguous)."""
    # A packet belongs to the last call that had started when it was captured: the phone
    # stamps a call's start before its first byte leaves and its end after its last arrives.
    starts = [c["t_start"] for c in calls]
    for d in (UP, DOWN):
        lo: list[float | None] = [None] * len(calls)
        hi: list[float | None] = [None] * len(calls)
        for start, end, t in units[d]:
            if end <= start:
                continue
            i = max(0, bisect.bisect_right(starts, t) - 1)
            lo[i] = start if lo[i] is None else min(lo[i], start)
            hi[i] = end if hi[i] is None else max(hi[i], end)
        # Calls without bytes of their own in this direction get an empty span where they are.
        cursor = 0
        for i, x in enumerate(exchanges):
            a = lo[i] if lo[i] is not None else cursor
            b = hi[i] if hi[i] is not None else a
            a = max(a, cursor)
            spans = list(x.spans)
            spans[d] = (a, max(a, b))
            x.spans = (spans[0], spans[1])
            cursor = max(cursor, b)


def analyse_phone(pcap: Path, calls_path: Path) -> list[Attribution]:
    """One :class:`Attribution` per TCP connection of a phone's link (its calls split by the
    connection they were in flight on).

    Raises
    ------
    WireError
        The capture or the call log cannot be read, or the capture holds no connection.
    """
    calls = read_calls(calls_path)
    conns = [c for c in connections(read_pcap(pcap)) if c.segments]
    if not conns:
        raise WireError(f"{pcap}: no TCP connection captured")
    out = []
    last_round: int | None = None
    kinds = []
    for call in calls:
        kind, rnd = _kind(call, last_round)
        if kind == "train-down":
            last_round = rnd
        kinds.append((kind, rnd))
    for n, conn in enumerate(conns):
        t0 = conn.start_s
        t1 = conns[n + 1].start_s if n + 1 < len(conns) else float("inf")
        mine = [(c, k) for c, k in zip(calls, kinds, strict=True) if t0 - 1.0 <= c["t_end"]
                and c["t_start"] < t1]
        if not mine:
            out.append(attribute(conn, [], None))
            continue
        exchanges = []
        for call, (kind, rnd) in mine:
            x = Exchange(conn.index, call["method"], kind, rnd, ((0, 0), (0, 0)))
            x.detail["messages"] = (len(call["request_bytes"]), len(call["response_bytes"]))
            exchanges.append(x)
        my_calls = [c for c, _ in mine]
        tls = None
        if looks_like_tls(conn.streams[UP]):
            tls = _tls_streams(conn)
            index = [_segment_times(conn, d) for d in (UP, DOWN)]
            units = [[(r.plain_start, r.plain_end, _time_of(r.start, index[d]))
                      for r in tls[d].records] for d in (UP, DOWN)]
        else:
            units = [[(s.new_start, s.new_end, s.t) for s in conn.segments if s.direction == d]
                     for d in (UP, DOWN)]
        _owners(conn, my_calls, exchanges, units)
        for x, call in zip(exchanges, my_calls, strict=True):
            for d, sizes, payload in ((UP, call["request_bytes"], call.get("payload_up", 0)),
                                      (DOWN, call["response_bytes"],
                                       call.get("payload_down", 0))):
                plain = x.spans[d][1] - x.spans[d][0]
                messages = sum(sizes)
                part = x.bytes[d]
                part["payload"] += payload
                part["fedgc"] += messages - payload
                part["http"] += plain - messages
        out.append(attribute(conn, exchanges, tls))
    return out


def http2_data_bytes(stream: bytes, client: bool) -> int:
    """Bytes of gRPC messages (prefix included) in a plaintext HTTP/2 stream: the payloads of
    its DATA frames less their padding. Used to check the call log against the wire."""
    pos = len(_PREFACE) if client and stream.startswith(_PREFACE) else 0
    total = 0
    while pos + 9 <= len(stream):
        length = int.from_bytes(stream[pos:pos + 3], "big")
        kind, flags = stream[pos + 3], stream[pos + 4]
        body = stream[pos + 9:pos + 9 + length]
        if kind == 0:  # DATA
            pad = body[0] + 1 if flags & 0x08 and body else 0
            total += length - pad
        pos += 9 + length
    return total
