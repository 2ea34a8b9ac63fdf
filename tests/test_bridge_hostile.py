"""The bridge under hostile phones: stalls, floods of uploads, late updates, probing."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import grpc
import pytest
import torch

import dgc
from android_bridge.bridge import SESSION_METADATA_KEY, PhoneBridge
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from dgc import SparseUpdate
from tests.test_bridge import TOKENS, _task

torch.set_num_threads(1)


@pytest.fixture()
def plain_bridge():
    # Plaintext on loopback: these tests are about the bridge's bounds, not TLS.
    with PhoneBridge(TOKENS, "127.0.0.1:0", max_chunk_bytes=1024,
                     stream_idle_timeout_s=10.0) as b:
        yield b


def _stub(bridge: PhoneBridge) -> tuple[grpc.Channel, pb_grpc.FedgcBridgeStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{bridge.port}")
    return channel, pb_grpc.FedgcBridgeStub(channel)


def _register(stub: pb_grpc.FedgcBridgeStub, device: str) -> str:
    return stub.Register(pb.RegisterRequest(device_id=device, token=TOKENS[device]),
                         timeout=5).session_id


def _upload(stub, session, task, data, upload_id="u", metrics=None, chunk_bytes=1024):
    digest = hashlib.sha256(data).hexdigest()
    metrics_json = json.dumps(metrics if metrics is not None else {"num-examples": 60})
    chunks = [pb.UploadChunk(session_id=session, task_id=task.task_id, upload_id=upload_id,
                             offset=o, data=data[o:o + chunk_bytes], total_bytes=len(data),
                             sha256=digest, metrics_json=metrics_json)
              for o in range(0, len(data), chunk_bytes)]
    return stub.UploadUpdate(iter(chunks), metadata=((SESSION_METADATA_KEY, session),),
                             timeout=10)


def _update(task, state) -> bytes:
    grads = {k: torch.full_like(v, 0.01) for k, v in state.items()}
    return dgc.encode(SparseUpdate.from_dense(grads, "float32", task.sequence))


def _deliver(bridge, stub, session, device):
    """Submit a task for ``device`` and upload a valid update for it; the upload's status."""
    task, state = _task(device)
    bridge.submit(task)
    data = _update(task, state)
    status = _upload(stub, session, task, data)
    assert status.complete and status.state == pb.DELIVERED, status
    assert bridge.wait(task.task_id, 5).update_bytes == data
    return status


def _open_task(bridge, stub, device):
    """Register ``device`` and submit a task for it: (session, its call metadata, task, state)."""
    session = _register(stub, device)
    task, state = _task(device)
    bridge.submit(task)
    return session, ((SESSION_METADATA_KEY, session),), task, state


def _release(streams):
    for _, release in streams:
        release.set()


def _idle_stream(stub, metadata=()):
    """An UploadUpdate stream that never sends a chunk (until ``release`` is set)."""
    release = threading.Event()

    def never():
        release.wait()
        return
        yield  # a generator that yields nothing

    future = stub.UploadUpdate.future(never(), metadata=metadata, timeout=30)
    return future, release


def test_idle_streams_without_a_token_do_not_stall_a_real_phone(plain_bridge):
    channel, stub = _stub(plain_bridge)
    idle = [_idle_stream(stub) for _ in range(8)]
    idle += [_idle_stream(stub, ((SESSION_METADATA_KEY, "forged"),)) for _ in range(8)]
    try:
        # Refused at once: no session in the metadata, or a forged one.
        for future, _ in idle:
            with pytest.raises(grpc.RpcError) as ex:
                future.result(timeout=5)
            assert ex.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "fedgc-session" in ex.value.details() or "unknown session" in \
                ex.value.details()
        # A real phone still registers and uploads.
        session = _register(stub, "phone-a")
        _deliver(plain_bridge, stub, session, "phone-a")
    finally:
        _release(idle)
        channel.close()


def test_authenticated_idle_streams_are_bounded_and_expire():
    # An idle deadline long enough that the held streams outlive the checks on a loaded machine.
    bridge = PhoneBridge(TOKENS, "127.0.0.1:0", stream_idle_timeout_s=5.0)
    bridge.start()
    channel, stub = _stub(bridge)
    session = _register(stub, "phone-b")
    meta = ((SESSION_METADATA_KEY, session),)
    held = [_idle_stream(stub, meta) for _ in range(bridge.max_streams_per_device)]
    try:
        deadline = time.monotonic() + 5
        while bridge.stats()["streams"] < len(held):  # the held streams reach the bridge first
            assert time.monotonic() < deadline, bridge.stats()
            time.sleep(0.02)
        extra, release = _idle_stream(stub, meta)
        with pytest.raises(grpc.RpcError) as ex:
            extra.result(timeout=5)
        release.set()
        assert ex.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "phone-b" in ex.value.details()
        # Another device is not held up by phone-b's streams.
        _deliver(bridge, stub, _register(stub, "phone-a"), "phone-a")
        # The idle deadline cancels phone-b's streams (CANCELLED: the bridge ended them; the
        # client's own deadline, 30 s, would read DEADLINE_EXCEEDED).
        for future, _ in held:
            with pytest.raises(grpc.RpcError) as ex:
                future.result(timeout=25)
            assert ex.value.code() == grpc.StatusCode.CANCELLED
        # ... and their workers: the handlers end just after the client hears of it.
        deadline = time.monotonic() + 5
        while bridge.stats()["streams"]:
            assert time.monotonic() < deadline, bridge.stats()
            time.sleep(0.02)
    finally:
        _release(held)
        channel.close()
        bridge.stop()


def test_thirty_rounds_leave_nothing_behind(plain_bridge):
    """Tasks, uploads and their bytes are pruned when done; sessions are bounded per device."""
    channel, stub = _stub(plain_bridge)
    task, state = _task("phone-a")
    for server_round in range(1, 31):
        session = _register(stub, "phone-a")  # a phone that registers again every round
        task, _ = _task("phone-a", server_round=server_round)
        plain_bridge.submit(task)
        status = _upload(stub, session, task, _update(task, state), upload_id=f"u{server_round}")
        assert status.state == pb.DELIVERED
        plain_bridge.wait(task.task_id, 5)
    stats = plain_bridge.stats()
    assert stats["tasks"] == 0 and stats["open_tasks"] == 0 and stats["results"] == 0
    assert stats["upload_bytes"] == 0
    assert stats["uploads"] == plain_bridge.finished_uploads_kept
    assert stats["sessions"] == plain_bridge.max_sessions_per_device
    # The newest upload still answers Ack; the oldest were pruned alike to unknown ones.
    ack = stub.Ack(pb.AckRequest(session_id=session, upload_id="u30"))
    assert ack.state == pb.DELIVERED
    with pytest.raises(grpc.RpcError) as ex:
        stub.Ack(pb.AckRequest(session_id=session, upload_id="u1"))
    assert ex.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


def test_partial_uploads_per_device_and_the_cap_from_the_model(plain_bridge):
    channel, stub = _stub(plain_bridge)
    session, meta, task, _ = _open_task(plain_bridge, stub, "phone-a")
    cap = 2 * len(task.dense_model) + 4096
    assert stub.FetchTask(pb.FetchTaskRequest(session_id=session)).max_update_bytes == cap

    def first_chunk(upload_id, total_bytes):
        return pb.UploadChunk(session_id=session, task_id=task.task_id, upload_id=upload_id,
                              offset=0, data=b"x" * 1000, total_bytes=total_bytes,
                              sha256="0" * 64, metrics_json='{"num-examples": 60}')

    with pytest.raises(grpc.RpcError) as ex:
        stub.UploadUpdate(iter([first_chunk("big", cap + 1)]), metadata=meta)
    assert ex.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"total_bytes must be in [1, {cap}]" in ex.value.details()
    # 200 partial uploads of the largest size: only max_partial_uploads_per_device are kept.
    refused = 0
    for i in range(200):
        try:
            stub.UploadUpdate(iter([first_chunk(f"p{i}", cap)]), metadata=meta)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "incomplete uploads" in err.details()
            refused += 1
    kept = plain_bridge.max_partial_uploads_per_device
    assert refused == 200 - kept
    assert plain_bridge.stats()["upload_bytes"] == 1000 * kept
    # Closing the task (its wait ran out) frees them, and tells the phone the truth.
    with pytest.raises(Exception, match="delivered no update"):
        plain_bridge.wait(task.task_id, 0.1)
    assert plain_bridge.stats()["upload_bytes"] == 0
    status = stub.QueryUpload(pb.QueryUploadRequest(session_id=session, upload_id="p0"))
    assert status.complete and status.state == pb.MISSED_ROUND
    assert "not aggregated" in status.detail
    channel.close()


def test_an_update_finished_after_its_round_is_not_acknowledged_as_delivered(plain_bridge):
    channel, stub = _stub(plain_bridge)
    session, meta, task, state = _open_task(plain_bridge, stub, "phone-b")
    data = _update(task, state)
    digest = hashlib.sha256(data).hexdigest()

    def chunk(offset, end):
        return pb.UploadChunk(session_id=session, task_id=task.task_id, upload_id="late",
                              offset=offset, data=data[offset:end], total_bytes=len(data),
                              sha256=digest, metrics_json='{"num-examples": 60}')

    assert stub.UploadUpdate(iter([chunk(0, 1000)]), metadata=meta).received_bytes == 1000
    with pytest.raises(Exception, match="delivered no update"):
        plain_bridge.wait(task.task_id, 0.1)  # the round stops waiting
    rest = [chunk(o, o + 1000) for o in range(1000, len(data), 1000)]
    status = stub.UploadUpdate(iter(rest), metadata=meta)
    assert status.complete and status.state == pb.MISSED_ROUND
    ack = stub.Ack(pb.AckRequest(session_id=session, upload_id="late"))
    assert ack.state == pb.MISSED_ROUND and "not aggregated" in ack.detail
    assert ack.last_aggregated_sequence == -1
    assert plain_bridge.stats()["results"] == 0
    channel.close()


def test_nested_metrics_and_probing_get_clear_and_alike_answers(plain_bridge):
    channel, stub = _stub(plain_bridge)
    a, b = _register(stub, "phone-a"), _register(stub, "phone-b")
    task, state = _task("phone-a")
    plain_bridge.submit(task)
    data = _update(task, state)
    for metrics, text in (("[" * 3000 + "]" * 3000, "exceeds 4096 bytes"),
                          ("[" * 2000 + "]" * 2000, "nested too deeply"),
                          ('{"num-examples": {"a": 1}}', "value of 'num-examples' is a dict")):
        with pytest.raises(grpc.RpcError) as ex:
            stub.UploadUpdate(iter([pb.UploadChunk(
                session_id=a, task_id=task.task_id, upload_id="m", offset=0, data=data[:10],
                total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                metrics_json=metrics)]), metadata=((SESSION_METADATA_KEY, a),))
        assert ex.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert text in ex.value.details(), ex.value.details()
    assert _upload(stub, a, task, data, upload_id="mine").state == pb.DELIVERED
    # phone-b asking about phone-a's upload id learns what it learns of an unknown id.
    theirs = stub.QueryUpload(pb.QueryUploadRequest(session_id=b, upload_id="mine"))
    unknown = stub.QueryUpload(pb.QueryUploadRequest(session_id=b, upload_id="nope"))
    assert (theirs.received_bytes, theirs.complete, theirs.state) == (
        unknown.received_bytes, unknown.complete, unknown.state) == (0, False, 0)
    details = []
    for upload_id in ("mine", "nope"):
        with pytest.raises(grpc.RpcError) as ex:
            stub.Ack(pb.AckRequest(session_id=b, upload_id=upload_id))
        details.append((ex.value.code(), ex.value.details().replace(repr(upload_id), "ID")))
    assert details[0] == details[1]
    channel.close()


def test_refused_first_chunks_hold_no_partial_upload_slot(plain_bridge):
    """Issue 26: a first chunk with an offset gap or one larger than its upload was refused
    after the upload was kept, so two of them held both slots and the real upload was refused."""
    channel, stub = _stub(plain_bridge)
    session, meta, task, state = _open_task(plain_bridge, stub, "phone-a")
    data = _update(task, state)
    digest = hashlib.sha256(data).hexdigest()
    for upload_id, offset, piece, total, code in (
            ("gap", 500, b"x" * 100, len(data), grpc.StatusCode.OUT_OF_RANGE),
            ("overflow", 0, b"x" * 200, 100, grpc.StatusCode.INVALID_ARGUMENT),
            ("too-big", 0, b"x" * 1025, len(data), grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as ex:
            stub.UploadUpdate(iter([pb.UploadChunk(
                session_id=session, task_id=task.task_id, upload_id=upload_id, offset=offset,
                data=piece, total_bytes=total, sha256=digest,
                metrics_json='{"num-examples": 60}')]), metadata=meta)
        assert ex.value.code() == code, ex.value.details()
        assert stub.QueryUpload(pb.QueryUploadRequest(
            session_id=session, upload_id=upload_id)).received_bytes == 0
    assert plain_bridge.stats()["uploads"] == 0
    assert _upload(stub, session, task, data).state == pb.DELIVERED
    assert plain_bridge.wait(task.task_id, 5).update_bytes == data
    channel.close()


@pytest.mark.parametrize("metrics_json, words", [
    ('{"num-examples": Infinity}', "Infinity is not a JSON number"),
    ('{"num-examples": NaN}', "NaN is not a JSON number"),
    ('{"num-examples": 60, "train_loss": -Infinity}', "-Infinity is not a JSON number"),
    ('{"num-examples": "ten"}', "num-examples = 'ten'; expected a whole number in [1, "),
    ('{"num-examples": 60.5}', "num-examples = 60.5; expected a whole number"),
    ('{"num-examples": 0}', "num-examples = 0; expected a whole number in [1, "),
    ('{"num-examples": true}', "num-examples = True"),
    ('{"num-examples": 4294967296}', "num-examples = 4294967296"),
    ('{"train_loss": 0.5}', "lacks 'num-examples'"),
    ('{"num-examples": 60, "train_loss": "low"}', "train_loss = 'low'; expected a finite"),
    ('{"num-examples": 60, "restored": -1}', "restored = -1; expected a whole number in [0, "),
    ('{"num-examples": 60, "restored": 0.5}', "restored = 0.5"),
])
def test_metrics_the_federation_cannot_use_are_refused_before_delivery(
        plain_bridge, metrics_json, words):
    """Issue 26: such metrics were acknowledged DELIVERED, then bridge_app's int()/float()
    failed (or truncated 60.5 to 60 before the server's check)."""
    channel, stub = _stub(plain_bridge)
    session, meta, task, state = _open_task(plain_bridge, stub, "phone-a")
    data = _update(task, state)
    with pytest.raises(grpc.RpcError) as ex:
        stub.UploadUpdate(iter([pb.UploadChunk(
            session_id=session, task_id=task.task_id, upload_id="m", offset=0,
            data=data[:1000], total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
            metrics_json=metrics_json)]), metadata=meta)
    assert ex.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in ex.value.details(), ex.value.details()
    assert plain_bridge.stats()["results"] == 0 and plain_bridge.stats()["uploads"] == 0
    # The same update with usable metrics is delivered, its num-examples as sent.
    status = _upload(stub, session, task, data, metrics={"num-examples": 61, "restored": 1,
                                                         "train_loss": 0.25})
    assert status.state == pb.DELIVERED
    assert plain_bridge.wait(task.task_id, 5).metrics["num-examples"] == 61
    channel.close()
