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
                     stream_idle_timeout_s=1.0) as b:
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
        task, state = _task("phone-a")
        plain_bridge.submit(task)
        data = _update(task, state)
        status = _upload(stub, session, task, data)
        assert status.complete and status.state == pb.DELIVERED
        assert plain_bridge.wait(task.task_id, 5).update_bytes == data
    finally:
        for _, release in idle:
            release.set()
        channel.close()


def test_authenticated_idle_streams_are_bounded_and_expire(plain_bridge):
    channel, stub = _stub(plain_bridge)
    session = _register(stub, "phone-b")
    meta = ((SESSION_METADATA_KEY, session),)
    held = [_idle_stream(stub, meta) for _ in range(plain_bridge.max_streams_per_device)]
    try:
        time.sleep(0.3)  # the held streams reach the bridge first
        extra, release = _idle_stream(stub, meta)
        with pytest.raises(grpc.RpcError) as ex:
            extra.result(timeout=5)
        release.set()
        assert ex.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "phone-b" in ex.value.details()
        # Another device is not held up by phone-b's streams.
        other = _register(stub, "phone-a")
        task, state = _task("phone-a")
        plain_bridge.submit(task)
        assert _upload(stub, other, task, _update(task, state)).state == pb.DELIVERED
        # The idle deadline (1 s here) cancels phone-b's streams.
        started = time.monotonic()
        for future, _ in held:
            with pytest.raises(grpc.RpcError) as ex:
                future.result(timeout=10)
            assert ex.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - started < 8
        assert plain_bridge.stats()["streams"] == 0
    finally:
        for _, release in held:
            release.set()
        channel.close()
