"""Wire accounting on real captures: tcpdump, TCP reassembly, TLS 1.3 decryption from a key log,
HTTP/1.1; and (slow) a deployment's every byte split into payload, fedgc, Flower, HTTP, TLS and
TCP/IP."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
from pathlib import Path

import pytest

from simulations.deploy.capture import PacketCapture, missing_reason
from simulations.wire.errors import WireError
from simulations.wire.http1 import parse_messages
from simulations.wire.ledger import CATEGORIES
from simulations.wire.pcap import read_pcap
from simulations.wire.tcp import DOWN, UP, connections
from simulations.wire.tls import client_random, decrypt_connection, read_keylog

needs_capture = pytest.mark.skipif(missing_reason() is not None,
                                   reason=str(missing_reason()))


def _request(body: bytes) -> bytes:
    return (b"POST /v1/echo HTTP/1.1\r\nHost: x\r\ncontent-type: application/protobuf\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _serve(server: ssl.SSLSocket, bodies: list[bytes]) -> None:
    conn, _ = server.accept()
    with conn:
        buf = b""
        for body in bodies:
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, _, rest = buf.partition(b"\r\n\r\n")
            size = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            while len(rest) < size:
                rest += conn.recv(65536)
            buf = rest[size:]
            conn.sendall(_response(body[::-1]))


@needs_capture
def test_a_tls_capture_decrypts_to_exactly_the_bytes_sent(tmp_path: Path) -> None:
    """Two HTTP/1.1 exchanges over one TLS 1.3 connection on loopback, captured by tcpdump:
    the decrypted streams are the bytes each side wrote, and headers, TLS and plaintext add
    up to every byte captured."""
    from simulations.deploy.certs import make_tls

    tls = make_tls(tmp_path / "tls", ["127.0.0.1"])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tls.server_cert, tls.server_key)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.load_verify_locations(tls.ca_cert)
    client_ctx.keylog_filename = str(tmp_path / "keys")
    bodies = [os.urandom(300), os.urandom(40_000)]
    raw = socket.create_server(("127.0.0.1", 0))
    port = raw.getsockname()[1]
    server = server_ctx.wrap_socket(raw, server_side=True)
    # Only this test's port: loopback carries other processes' traffic too.
    capture = PacketCapture("lo", tmp_path / "lo.pcap", bpf_filter=f"tcp port {port}").start()
    thread = threading.Thread(target=_serve, args=(server, bodies))
    thread.start()
    sent, received = b"", b""
    try:
        with client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                    server_hostname="127.0.0.1") as sock:
            for body in bodies:
                sent += _request(body)
                sock.sendall(_request(body))
                want = len(_response(body))
                got = b""
                while len(got) < want:
                    got += sock.recv(65536)
                received += got
        thread.join(10)
    finally:
        capture.stop()
        server.close()
    (conn,) = [c for c in connections(read_pcap(tmp_path / "lo.pcap"))
               if port in (c.server[1], c.client[1])]
    keys = read_keylog(tmp_path / "keys")
    up, down = decrypt_connection(conn.streams[UP], conn.streams[DOWN],
                                  keys[client_random(conn.streams[UP])], "test")
    assert up.plaintext == sent and down.plaintext == received
    requests, rest = parse_messages(up.plaintext, responses=False)
    assert [len(r.body) for r in requests] == [len(b) for b in bodies] and rest == 0
    for d, stream in ((UP, up), (DOWN, down)):
        tls_bytes = sum(r.overhead for r in stream.records)
        headers = sum(s.header_bytes for s in conn.segments if s.direction == d)
        wire = sum(s.wire_bytes for s in conn.segments if s.direction == d)
        assert headers + tls_bytes + len(stream.plaintext) == wire
        # An application record costs 22 bytes (header, inner type, tag) in TLS 1.3.
        data = [r for r in stream.records if r.plain_end > r.plain_start]
        assert all(r.overhead == 22 for r in data)


def test_bad_capture_and_key_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(WireError, match=r"missing.pcap: cannot read the capture"):
        read_pcap(tmp_path / "missing.pcap")
    bad = tmp_path / "bad.pcap"
    bad.write_bytes(b"\x00" * 30)
    with pytest.raises(WireError, match=r"bad.pcap: pcap magic 00000000, expected a classic "
                                        r"pcap file"):
        read_pcap(bad)
    head = bytes.fromhex("d4c3b2a1020004000000000000000000ffff000001000000")
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(head + bytes(16)[:10])
    with pytest.raises(WireError, match=r"cut.pcap: record 0 header truncated"):
        read_pcap(cut)
    keys = tmp_path / "keys"
    keys.write_text("CLIENT_TRAFFIC_SECRET_0 zz 00\n")
    with pytest.raises(WireError, match=r"keys:1: expected 'LABEL <hex client random> <hex "
                                        r"secret>'"):
        read_keylog(keys)


@pytest.mark.slow
@needs_capture
def test_a_deployment_capture_adds_up(tmp_path: Path) -> None:
    """digits, 2 nodes, 2 rounds, LTE, TLS: every captured byte is attributed, the payload on
    the link is what clients.csv recorded, and the categories add up to the total."""
    from simulations.deploy.cli import main

    results = tmp_path / "results"
    argv = ["--nodes", "2", "--link", "lte", "--tls", "--capture", "--workdir",
            str(tmp_path / "work"), "--set", "task=digits", "--set", "rounds=2",
            "--set", f"results_dir={results}", "--set", "run_name=cap", "--set",
            "progress=false"]
    assert main(argv) == 0
    ledger = json.loads((results / "cap" / "wire.json").read_text())
    assert ledger["attributed_fraction"]["up"] > 0.98 < ledger["attributed_fraction"]["down"]
    assert ledger["payload_bytes"] == ledger["payload_clients_csv"]
    assert ledger["client_rounds"] == 4
    for d in ("up", "down"):
        parts = ledger["whole_run_per_client_round"][d]
        total = sum(parts[k] for k in CATEGORIES) * ledger["client_rounds"]
        assert total + ledger["unattributed_bytes"][d] == pytest.approx(
            ledger["captured_bytes"][d], rel=1e-9)
    # Flower's protocol costs more than fedgc's payload for a compressed update.
    pcr = ledger["per_client_round"]["up"]
    assert pcr["flower"] > pcr["payload"] > 0
    assert ledger["idle"]["poll"]["interval_s"] == pytest.approx(3.0, abs=1.0)


def test_the_bridge_measurements_variants_are_dgc_and_dense_fedavgs_bytes() -> None:
    """``wire bridge --method dense`` is dense FedAvg through the bridge: every tensor of the
    phone's update dense in float32 (no indices), the exact model down; ``dgc`` a default run."""
    from simulations.wire.bridge_run import run_config
    from tasks import get_task

    dense = run_config("digits", "dense", 2, 3, 0, Path("/nonexistent"), "d")
    phone = dense.method.phone_config(dense.train)
    largest = max(p.numel() for p in get_task("digits").build_model().parameters())
    assert phone.min_sparse_numel > largest and phone.value_dtype == "float32"
    assert phone.density == 1.0 and dense.server.downlink_density == 1.0
    dgc = run_config("digits", "dgc", 2, 3, 0, Path("/nonexistent"), "g")
    assert dgc.method.name == "dgc" and dgc.method.phone_config(dgc.train).density < 0.01


@pytest.mark.slow
@needs_capture
def test_a_bridge_capture_counts_the_payload_the_server_counted(tmp_path: Path) -> None:
    """digits, one reference phone, 2 rounds, LTE, TLS: every captured byte attributed, and the
    payload on the phone's link is what clients.csv recorded (the model or patch and, down, the
    sign channel's index sets; the server counts both as the client's downlink)."""
    from simulations.wire.bridge_run import main

    assert main(["--task", "digits", "--method", "dgc", "--link", "lte", "--phones", "1",
                 "--rounds", "2", "--out", str(tmp_path)]) == 0
    ledger = json.loads(next(tmp_path.glob("*/wire.json")).read_text())
    assert ledger["attributed_fraction"]["up"] > 0.98 < ledger["attributed_fraction"]["down"]
    assert ledger["payload_bytes"]["up"] == ledger["payload_clients_csv"]["up"]
    assert ledger["payload_bytes"]["down"] == pytest.approx(
        ledger["payload_clients_csv"]["down"], rel=0.01)
    assert ledger["client_rounds"] == 2
