"""The phone bridge's bounds, measured: what hostile phones can hold, and what a real one feels.

Prints, for the numbers in docs/threat_model.md:

1. A real phone's ``Register`` + ``FetchTask`` latency (median of ``--repeats``) with nothing
   else open (the baseline, measured in the same run), with 64 idle ``UploadUpdate`` streams
   without a session (refused at once), and with every stream slot held by authenticated idle
   streams (``max_streams`` of them, 2 per device): ratios against the baseline.
2. The idle deadline: how long after its last chunk a stream is cancelled (configured
   ``--idle-s``), median over the held streams.
3. One device opening 200 partial uploads of the largest size its task allows: how many the
   bridge keeps, and the bytes it holds.
4. 30 rounds of a device that registers again each round: what the bridge holds afterwards
   (``PhoneBridge.stats()``) and the Python heap it grew by (``tracemalloc``).

Plaintext gRPC on loopback (TLS changes none of the counts). The model is the digits task's
(15,010 parameters, 60 kB dense). Run: ``python bench/bridge_limits.py`` (about 30 s).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time
import tracemalloc

import grpc
import torch

import dgc
from android_bridge.bridge import SESSION_METADATA_KEY, PhoneBridge, PhoneTask
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc


def _task(device: str, server_round: int = 1) -> tuple[PhoneTask, dict[str, torch.Tensor]]:
    from tasks import get_task

    torch.manual_seed(0)
    state = {k: v.detach() for k, v in get_task("digits").build_model().state_dict().items()}
    return PhoneTask(device_id=device, server_round=server_round, model_version=0,
                     sequence=server_round, ack_sequence=-1,
                     dense_model=dgc.encode(dgc.SparseUpdate.from_dense(state, "float32")),
                     config={}), state


def _idle(stub: pb_grpc.FedgcBridgeStub, metadata: tuple = ()) -> tuple[object, threading.Event]:
    release = threading.Event()

    def never():
        release.wait()
        return
        yield

    return stub.UploadUpdate.future(never(), metadata=metadata, timeout=120), release


def _phone_latency_s(stub: pb_grpc.FedgcBridgeStub, device: str, token: str,
                     repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session = stub.Register(pb.RegisterRequest(device_id=device, token=token),
                                timeout=10).session_id
        stub.FetchTask(pb.FetchTaskRequest(session_id=session), timeout=10)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--idle-s", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokens = {f"phone-{i}": f"{i:02d}" + "t" * 20 for i in range(12)}
    bridge = PhoneBridge(tokens, "127.0.0.1:0", stream_idle_timeout_s=args.idle_s)
    bridge.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{bridge.port}")
    stub = pb_grpc.FedgcBridgeStub(channel)
    real, real_token = "phone-11", tokens["phone-11"]
    try:
        base = _phone_latency_s(stub, real, real_token, args.repeats)
        print(f"1. real phone Register+FetchTask, median of {args.repeats}:")
        print(f"   nothing else open                      {base * 1e3:7.2f} ms")
        idle = [_idle(stub) for _ in range(64)]
        refused = 0
        for future, _ in idle:
            try:
                future.result(timeout=10)
            except grpc.RpcError as ex:
                refused += ex.code() == grpc.StatusCode.UNAUTHENTICATED
        t = _phone_latency_s(stub, real, real_token, args.repeats)
        print(f"   64 idle streams without a session      {t * 1e3:7.2f} ms  x{t / base:5.2f} "
              f"({refused} of 64 refused at once)")
        for _, release in idle:
            release.set()
        held, opened = [], time.monotonic()
        for i in range(bridge.max_streams // bridge.max_streams_per_device):
            device = f"phone-{i}"
            session = stub.Register(pb.RegisterRequest(device_id=device,
                                                       token=tokens[device])).session_id
            held += [_idle(stub, ((SESSION_METADATA_KEY, session),))
                     for _ in range(bridge.max_streams_per_device + 1)]
        time.sleep(0.3)
        exhausted = sum(1 for f, _ in held if f.done())
        t = _phone_latency_s(stub, real, real_token, args.repeats)
        print(f"   {bridge.stats()['streams']} authenticated idle streams (all slots)  "
              f"{t * 1e3:7.2f} ms  x{t / base:5.2f} ({exhausted} more refused: "
              f"RESOURCE_EXHAUSTED)")
        ends = []
        for future, release in held:
            try:
                future.result(timeout=args.idle_s * 10)
            except grpc.RpcError:
                ends.append(time.monotonic() - opened)
            release.set()
        print(f"2. idle deadline {args.idle_s:.1f} s: the held streams ended after "
              f"{statistics.median(ends):.2f} s (median; watchdog period "
              f"{min(1.0, args.idle_s / 4):.2f} s)")

        session = stub.Register(pb.RegisterRequest(device_id=real, token=real_token)).session_id
        task, state = _task(real)
        bridge.submit(task)
        cap = min(bridge.max_update_bytes, 2 * len(task.dense_model) + 4096)
        kept = 0
        for i in range(200):
            chunk = pb.UploadChunk(session_id=session, task_id=task.task_id, upload_id=f"p{i}",
                                   offset=0, data=b"x" * bridge.max_chunk_bytes,
                                   total_bytes=cap, sha256="0" * 64)
            try:
                stub.UploadUpdate(iter([chunk]), metadata=((SESSION_METADATA_KEY, session),))
                kept += 1
            except grpc.RpcError:
                pass
        held_bytes = bridge.stats()["upload_bytes"]
        print(f"3. 200 partial uploads of {cap} bytes (the task's cap) from one device: {kept} "
              f"kept, {held_bytes} bytes held (at most {kept} x {cap} = {kept * cap} if "
              f"completed)")
        try:
            bridge.wait(task.task_id, 0.05)
        except Exception:  # the round stops waiting: the partial uploads go
            pass
        print(f"   after the round stopped waiting: {bridge.stats()['upload_bytes']} bytes held")

        grads = {k: torch.full_like(v, 0.01) for k, v in state.items()}
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for r in range(1, 31):
            session = stub.Register(pb.RegisterRequest(device_id=real,
                                                       token=real_token)).session_id
            task, _ = _task(real, r)
            bridge.submit(task)
            data = dgc.encode(dgc.SparseUpdate.from_dense(grads, "float32", r))
            digest = hashlib.sha256(data).hexdigest()
            step = bridge.max_chunk_bytes
            chunks = [pb.UploadChunk(session_id=session, task_id=task.task_id,
                                     upload_id=f"u{r}", offset=o, data=data[o:o + step],
                                     total_bytes=len(data), sha256=digest,
                                     metrics_json='{"num-examples": 60}')
                      for o in range(0, len(data), step)]
            stub.UploadUpdate(iter(chunks), metadata=((SESSION_METADATA_KEY, session),))
            result = bridge.wait(task.task_id, 10)
            del result, task, chunks, data
        after = tracemalloc.take_snapshot()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        tracemalloc.stop()
        print(f"4. 30 rounds of a 60 kB update, registering again each "
              f"round: bridge holds {bridge.stats()}; Python heap grew {grown / 1024:.0f} KiB")
    finally:
        channel.close()
        bridge.stop()


if __name__ == "__main__":
    main()
