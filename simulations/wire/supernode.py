"""A SuperNode's link, from its capture: every Fleet RPC with its bytes per category."""

from __future__ import annotations

from pathlib import Path

from .errors import WireError
from .fleet import FleetSession
from .http1 import parse_messages
from .ledger import Attribution, attribute
from .pcap import read_pcap
from .tcp import DOWN, UP, connections
from .tls import (
    CHANGE_CIPHER_SPEC,
    HANDSHAKE,
    client_random,
    decrypt_connection,
    looks_like_tls,
    read_keylog,
    split_records,
)


def analyse_supernode(pcap: Path, keylog: Path | None = None) -> list[Attribution]:
    """One :class:`Attribution` per TCP connection of the capture, in time order.

    Raises
    ------
    WireError
        The capture cannot be read, or it holds TLS and ``keylog`` is missing or lacks the
        secrets of a connection whose handshake completed.
    """
    capture = read_pcap(pcap)
    secrets = read_keylog(keylog) if keylog is not None and Path(keylog).exists() else None
    session = FleetSession()
    out = []
    # Objects are named in one RPC and fetched in the next, possibly on another connection:
    # exchanges are classified in the order their requests started.
    pending = []
    for conn in connections(capture):
        up, down = conn.streams
        tls = None
        if looks_like_tls(up):
            random = client_random(up)
            where = f"{pcap} connection {conn.index} ({conn.client[0]}:{conn.client[1]})"
            if secrets is None:
                raise WireError(f"{where}: TLS traffic, but no key log "
                                f"({keylog or 'none given'}); capture with the SuperNode's "
                                f"TLS secrets (deploy --capture logs them)")
            if random not in secrets and _handshake_only(up):
                # The client never finished its handshake (a SuperNode killed during it: TLS
                # libraries log a connection's secrets once it completes). No message crossed
                # it; its bytes stay unattributed.
                pending.append((conn, None, [], [], (0, 0)))
                continue
            if random not in secrets:
                raise WireError(f"{where}: the key log {keylog} has no secrets for client "
                                f"random {random.hex() if random else '?'}")
            tls = decrypt_connection(up, down, secrets[random], where, conn.missing)
            up, down = tls[UP].plaintext, tls[DOWN].plaintext
        requests, rest_up = parse_messages(up, responses=False)
        responses, rest_down = parse_messages(down, responses=True)
        pending.append((conn, tls, requests, responses, (rest_up, rest_down)))
    per_conn: list[list] = [[None] * len(p[2]) for p in pending]
    request_times = _request_times(pending)
    order = sorted((request_times[i][j], i, j) for i, p in enumerate(pending)
                   for j in range(len(p[2])))
    for _, i, j in order:
        conn, _, requests, responses, _ = pending[i]
        response = responses[j] if j < len(responses) else None
        per_conn[i][j] = session.classify(requests[j], response, conn.index)
    for i, (conn, tls, requests, responses, rest) in enumerate(pending):
        exchanges = per_conn[i]
        for x in exchanges:
            stage = session.stage(x)
            if stage is not None:
                x.detail["secagg_stage"] = stage
        extra_down = sum(r.end - r.start for r in responses[len(requests):])
        out.append(attribute(conn, exchanges, tls, (rest[UP], rest[DOWN] + extra_down)))
    return out


def _handshake_only(client_stream: bytes) -> bool:
    """Whether a TLS client stream holds only cleartext handshake records: the client never
    sent its (encrypted) Finished, so the connection carried no application data."""
    records, _ = split_records(client_stream)
    return all(r.outer_type in (HANDSHAKE, CHANGE_CIPHER_SPEC) for r in records)


def _request_times(pending: list) -> list[list[float]]:
    """When each request's first byte went out (plaintext offset -> the packet that carried
    it), so that RPCs on different connections are classified in the order they were made."""
    out = []
    for conn, tls, requests, _, _ in pending:
        times = []
        for req in requests:
            offset = req.start
            if tls is not None:  # plaintext offset -> the stream offset of its record
                record = next((r for r in tls[UP].records if r.plain_start <= offset
                               < r.plain_end), None)
                offset = record.start if record is not None else 0
            seg = next((s for s in conn.segments if s.direction == UP
                        and s.new_start <= offset < s.new_end), None)
            times.append(seg.t if seg is not None else conn.start_s)
        out.append(times)
    return out


def analyse_deployment(capture_dir: Path, nodes: int) -> dict[int, list[Attribution]]:
    """Every node's link of a deployment captured with ``deploy --capture``.

    Raises
    ------
    WireError
        A node's capture is missing or cannot be analysed.
    """
    out = {}
    for index in range(nodes):
        pcap = Path(capture_dir) / f"node{index}.pcap"
        if not pcap.exists():
            raise WireError(f"{pcap}: capture of node {index} missing")
        out[index] = analyse_supernode(pcap, Path(capture_dir) / f"node{index}.keys")
    return out
