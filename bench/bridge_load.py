"""The phone bridge under load: a thousand phones against one bridge on loopback.

Starts the bridge as a deployment runs it (``python -m android_bridge serve``: TLS, the control
socket, its defaults for that many devices) in a process of its own, and then:

- **phones**: ``--phones`` real gRPC clients over TLS, one channel each, run as asyncio tasks in
  ``--procs`` processes (grpc.aio). Each registers, then for every round long-polls
  ``FetchTask`` (the bridge's ``max_wait_s``; a call the bridge answers at once is repeated after
  ``poll_interval_s``, as ``android_bridge.phone`` does), "trains" for a random
  ``--train-s`` (a sleep: the bridge is under test, not the phone), and uploads its update in
  chunks of ``--chunk-bytes``. ``--cut`` of the uploads lose their stream after the first chunk
  and resume where ``QueryUpload`` says; ``--rejoin`` of the phones drop their channel after
  fetching their task and come back on a new one (a new TLS connection, ``Register`` again,
  the same task fetched again) before uploading. A stream refused with ``RESOURCE_EXHAUSTED``
  (every stream slot taken) is retried after a jittered backoff. An upload whose stream did not
  say how it ended is asked with ``Ack``.
- **the federation**: each round, one ``RunTask`` per phone on the control socket at once (what
  a SuperNode's ClientApp does per phone), from one asyncio process: submit, wait for the
  phone's update, get it back.

Reported: the bridge process's resident memory (``VmRSS``, sampled every 0.2 s: idle, with
every phone connected, the peak over the rounds, after them), the latency of every request
kind the phones make and of the federation's ``RunTask`` (p50, p99, max; a held ``FetchTask``
counts from the task's submission to its arrival, its hand-out delay), and the accounting:
every task's update must come back to the federation with the bytes the phone sent (sha256),
and every phone must read ``DELIVERED``: anything else is lost. Payload: the update's
wire-format bytes (``--update dense``: the digits model's 15,010 float32 values, 60,238 bytes;
``sparse``: 1% of them); bytes on the wire add gRPC, HTTP/2 and TLS framing, not counted here.

    python bench/bridge_load.py --phones 1000 --rounds 3 --procs 4 \
        --jsonl docs/bridge_load_runs.jsonl

The figures: docs/benchmarks.md, "The phone bridge under load".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.deploy.certs import make_tls  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rss_kib(pid: int) -> int:
    """A process's resident memory (``VmRSS``), KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1))


class RssSampler(threading.Thread):
    """Samples a process's VmRSS every ``period_s``; :meth:`mark` names the phase the next
    samples belong to."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.phase = "start"
        self.samples: dict[str, list[int]] = {}
        self.stopped = threading.Event()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                self.samples.setdefault(self.phase, []).append(_rss_kib(self.pid))
            except (OSError, AttributeError):
                return

    def now(self) -> int:
        return _rss_kib(self.pid)


def _percentiles(values: Iterable[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731 - nearest rank
    return {"n": len(v), "p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * at(0.99),
            "max_ms": 1e3 * v[-1]}


# --------------------------------------------------------------------------- the phones


def _update_bytes(task: Any, kind: str, rng: random.Random) -> bytes:
    """A phone's update for ``task``: the model's tensors (decoded from the task), dense or 1%
    of each, random values, the task's sequence; wire format."""
    import torch

    import dgc

    model = dgc.decode(task.model_bytes, max_numel=1 << 24).to_dense()
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    grads = {k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in model.items()}
    if kind == "dense":
        update = dgc.SparseUpdate.from_dense(grads, "float32", int(task.sequence))
    else:
        tensors = {}
        for name, g in grads.items():
            flat = g.reshape(-1)
            k = max(1, flat.numel() // 100)
            idx = torch.randperm(flat.numel(), generator=gen)[:k].sort().values.to(torch.int32)
            tensors[name] = dgc.SparseTensor(idx, flat[idx.long()], tuple(g.shape))
        update = dgc.SparseUpdate(tensors, int(task.sequence))
    return dgc.encode(update)


class Phone:
    """One phone: its channel, session and the record of its requests."""

    def __init__(self, device: str, token: str, worker: Worker) -> None:
        self.device, self.token, self.w = device, token, worker
        self.channel: Any = None
        self.stub: Any = None
        self.session = ""
        self.poll_s, self.max_wait_s = 1.0, 0.0

    async def connect(self) -> None:
        from grpc import aio

        from android_bridge.bridge import PHONE_CHANNEL_OPTIONS
        from android_bridge.proto import fedgc_bridge_pb2 as pb
        from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc

        if self.channel is not None:
            await self.channel.close()
        self.channel = aio.secure_channel(self.w.target, self.w.creds,
                                          options=list(PHONE_CHANNEL_OPTIONS))
        self.stub = pb_grpc.FedgcBridgeStub(self.channel)
        reply = await self.w.timed("Register", self.stub.Register(
            pb.RegisterRequest(device_id=self.device, token=self.token), timeout=120))
        self.session, self.poll_s, self.max_wait_s = (reply.session_id, reply.poll_interval_s,
                                                      reply.max_wait_s)

    async def fetch(self) -> Any:
        """The open task: long polls, or polls every poll_interval_s when not held."""
        from android_bridge.proto import fedgc_bridge_pb2 as pb

        while True:
            started = time.monotonic()
            request = pb.FetchTaskRequest(session_id=self.session, wait_s=self.max_wait_s)
            task = await self.stub.FetchTask(request, timeout=self.max_wait_s + 120)
            now = time.monotonic()
            if task.has_task:
                # From the task's submission (or this call, if it came later) to its arrival.
                sent = float(json.loads(task.config_json)["submitted_monotonic"])
                self.w.record("FetchTask: task hand-out delay", now - max(sent, started))
                return task
            if now - started < max(self.max_wait_s / 2, self.poll_s):
                # Answered at once, not held (the bridge holds max_waiting calls): poll again.
                self.w.record("FetchTask answered at once", now - started)
                await asyncio.sleep(self.poll_s)
            else:
                self.w.count("held FetchTask calls that ended without a task")

    async def upload(self, task: Any, data: bytes, cut: bool) -> int:
        """Send ``data``; return the state the bridge gave the upload."""
        import grpc

        from android_bridge.bridge import SESSION_METADATA_KEY
        from android_bridge.proto import fedgc_bridge_pb2 as pb

        upload_id = f"{self.device}-{task.task_id}"
        digest = hashlib.sha256(data).hexdigest()
        step = min(self.w.chunk_bytes, int(task.max_chunk_bytes) or self.w.chunk_bytes)
        metrics = json.dumps({"num-examples": 100, "train_loss": 1.0})
        offset, state, backoff = 0, 0, 0.05
        for attempt in range(64):
            if attempt:
                status = await self.w.timed("QueryUpload", self.stub.QueryUpload(
                    pb.QueryUploadRequest(session_id=self.session, upload_id=upload_id),
                    timeout=120))
                if status.complete:
                    return int(status.state)
                offset = int(status.received_bytes)
            stop_after = 1 if cut and attempt == 0 else None

            async def chunks(start: int = offset, stop: int | None = stop_after):
                for n, at in enumerate(range(start, len(data), step)):
                    if stop is not None and n >= stop:
                        return
                    yield pb.UploadChunk(task_id=task.task_id, upload_id=upload_id, offset=at,
                                         data=data[at:at + step], total_bytes=len(data),
                                         sha256=digest, metrics_json=metrics)

            started = time.monotonic()
            call = self.stub.UploadUpdate(chunks(), timeout=300,
                                          metadata=((SESSION_METADATA_KEY, self.session),))
            try:
                if stop_after is not None:
                    # The link drops once the first chunk is out: the call is cancelled
                    # after the bridge has it (QueryUpload then says where to resume).
                    while True:
                        await asyncio.sleep(0.02)
                        status = await self.stub.QueryUpload(pb.QueryUploadRequest(
                            session_id=self.session, upload_id=upload_id), timeout=120)
                        if status.received_bytes >= min(step, len(data)) or call.done():
                            break
                    call.cancel()
                    self.w.count("streams cut")
                    continue
                status = await call
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as ex:
                if ex.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.w.count("streams refused: RESOURCE_EXHAUSTED")
                    await asyncio.sleep(backoff * (1 + random.random()))
                    backoff = min(2 * backoff, 5.0)
                    continue
                if ex.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                    self.w.count(f"streams ended: {ex.code().name}")
                    continue
                raise
            self.w.record("UploadUpdate stream", time.monotonic() - started)
            state = int(status.state)
            if status.complete:
                return state
        raise ConnectionError(f"upload {upload_id} incomplete after 64 streams")

    async def run(self, rounds: int, rng: random.Random) -> None:
        from android_bridge.proto import fedgc_bridge_pb2 as pb

        await self.connect()
        self.w.connected += 1
        if self.w.connected == self.w.expected:
            Path(self.w.ready).write_text(str(self.w.connected))  # every phone registered
        for _ in range(rounds):
            task = await self.fetch()
            if rng.random() < self.w.rejoin:
                # The phone loses its link and comes back: a new channel, a new session, the
                # same task fetched again.
                await self.connect()
                self.w.count("phones rejoined")
                task = await self.fetch()
            await asyncio.sleep(rng.uniform(*self.w.train_s))
            data = _update_bytes(task, self.w.update, rng)
            state = await self.upload(task, data, rng.random() < self.w.cut)
            if state in (pb.UPDATE_STATE_UNSPECIFIED, pb.INCOMPLETE):
                reply = await self.w.timed("Ack", self.stub.Ack(pb.AckRequest(
                    session_id=self.session, upload_id=f"{self.device}-{task.task_id}"),
                    timeout=120))
                state = int(reply.state)
            self.w.uploads.append({"device": self.device, "task_id": task.task_id,
                                   "sha256": hashlib.sha256(data).hexdigest(),
                                   "state": pb.UpdateState.Name(state)})
        await self.channel.close()


class Worker:
    """A process of phones (``--phone-worker``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        self.target = f"127.0.0.1:{args.port}"
        self.creds = grpc.ssl_channel_credentials(Path(args.ca).read_bytes())
        self.chunk_bytes, self.update = args.chunk_bytes, args.update
        self.cut, self.rejoin = args.cut, args.rejoin
        self.train_s = (args.train_s[0], args.train_s[1])
        self.latency: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}
        self.uploads: list[dict[str, Any]] = []
        self.connected, self.expected, self.ready = 0, args.count, f"{args.out}.ready"

    def record(self, kind: str, seconds: float) -> None:
        self.latency.setdefault(kind, []).append(seconds)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def timed(self, kind: str, call: Any) -> Any:
        started = time.monotonic()
        out = await call
        self.record(kind, time.monotonic() - started)
        return out


async def _phones(args: argparse.Namespace) -> dict[str, Any]:
    w = Worker(args)
    devices = json.loads(Path(args.devices).read_text())
    mine = list(devices.items())[args.first:args.first + args.count]
    phones = [Phone(d, t, w) for d, t in mine]
    errors: list[str] = []

    async def one(p: Phone, seed: int) -> None:
        try:
            await p.run(args.rounds, random.Random(seed))
        except Exception as ex:  # noqa: BLE001 - every failure is a finding: reported
            errors.append(f"{p.device}: {type(ex).__name__}: {ex}"[:300])

    # Phones come online over --ramp-s, not in one instant.
    async def staggered(i: int, p: Phone) -> None:
        await asyncio.sleep(args.ramp_s * i / max(len(phones), 1))
        await one(p, args.seed * 100_003 + args.first + i)

    await asyncio.gather(*(staggered(i, p) for i, p in enumerate(phones)))
    return {"latency": w.latency, "counts": w.counts, "uploads": w.uploads, "errors": errors}


def phone_worker(args: argparse.Namespace) -> int:
    out = asyncio.run(_phones(args))
    Path(args.out).write_text(json.dumps(out))
    return 0


# --------------------------------------------------------------------------- the federation


async def _federation(args: argparse.Namespace, control: str, devices: list[str],
                      sampler: RssSampler) -> dict[str, Any]:
    """``--rounds`` rounds of one RunTask per device at once; what came back."""
    import torch
    from grpc import aio

    import dgc
    from android_bridge.bridge import PhoneTask
    from android_bridge.control import MAX_MESSAGE_BYTES, task_to_message
    from android_bridge.proto import fedgc_bridge_control_pb2_grpc as cpb_grpc
    from tasks import get_task

    torch.manual_seed(0)
    state = {k: v.detach() for k, v in get_task("digits").build_model().state_dict().items()}
    dense = dgc.encode(dgc.SparseUpdate.from_dense(state, "float32"))
    results: list[dict[str, Any]] = []
    latency: list[float] = []
    failures: list[str] = []
    rounds: list[dict[str, Any]] = []
    async with aio.insecure_channel(control, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]) as channel:
        stub = cpb_grpc.FedgcBridgeControlStub(channel)

        async def run_task(device: str, server_round: int) -> None:
            submitted = time.monotonic()
            task = PhoneTask(device_id=device, server_round=server_round,
                             model_version=server_round - 1, sequence=server_round,
                             ack_sequence=server_round - 1, dense_model=dense,
                             config={"submitted_monotonic": submitted})
            try:
                reply = await stub.RunTask(task_to_message(task, args.round_timeout_s),
                                           timeout=args.round_timeout_s + 60)
            except Exception as ex:  # noqa: BLE001 - a lost update, reported
                failures.append(f"round {server_round} {device}: {ex}"[:300])
                return
            latency.append(time.monotonic() - submitted)
            results.append({"device": device, "task_id": reply.task_id,
                            "sha256": hashlib.sha256(reply.update_bytes).hexdigest()})

        for r in range(1, args.rounds + 1):
            sampler.mark(f"round {r}")
            started = time.monotonic()
            await asyncio.gather(*(run_task(d, r) for d in devices))
            rounds.append({"round": r, "seconds": time.monotonic() - started,
                           "rss_kib": sampler.now()})
            print(f"  round {r}: {rounds[-1]['seconds']:.1f} s, bridge RSS "
                  f"{rounds[-1]['rss_kib'] / 1024:.0f} MiB", flush=True)
    return {"results": results, "latency": latency, "failures": failures, "rounds": rounds}


def _example_update_bytes(kind: str) -> int:
    """The wire-format bytes of one phone's update (what every upload carries)."""
    import torch

    import dgc
    from tasks import get_task

    state = get_task("digits").build_model().state_dict()
    task = argparse.Namespace(model_bytes=dgc.encode(dgc.SparseUpdate.from_dense(
        {k: v.detach() for k, v in state.items()}, "float32")), sequence=1)
    torch.manual_seed(0)
    return len(_update_bytes(task, kind, random.Random(0)))


def _start_bridge(workdir: Path, devices: Path, cert: Path, key: Path,
                  ) -> tuple[subprocess.Popen, int]:
    """``python -m android_bridge serve`` on a free loopback port: the process and its port."""
    bridge = subprocess.Popen(
        [sys.executable, "-m", "android_bridge", "serve", "--devices", str(devices),
         "--listen", "127.0.0.1:0", "--cert", str(cert), "--key", str(key),
         "--workdir", str(workdir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    assert bridge.stdout is not None
    for line in bridge.stdout:
        found = re.search(r"phones connect to [\d.]+:(\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in bridge.stdout], daemon=True).start()
            return bridge, int(found.group(1))
    raise RuntimeError(f"the bridge exited ({bridge.wait()}) before it listened")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phones", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--procs", type=int, default=4, help="processes the phones run in")
    p.add_argument("--update", choices=("dense", "sparse"), default="dense")
    p.add_argument("--chunk-bytes", type=int, default=16 * 1024)
    p.add_argument("--cut", type=float, default=0.1, help="share of uploads cut once")
    p.add_argument("--rejoin", type=float, default=0.05,
                   help="share of phone rounds that reconnect before uploading")
    p.add_argument("--train-s", type=float, nargs=2, default=(0.1, 2.0))
    p.add_argument("--ramp-s", type=float, default=5.0, help="phones come online over this")
    p.add_argument("--round-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jsonl", help="append the figures as one JSON row")
    # A process of phones (started by main).
    p.add_argument("--phone-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ca", help=argparse.SUPPRESS)
    p.add_argument("--devices", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phone_worker:
        return phone_worker(args)

    work = Path(tempfile.mkdtemp(prefix="fedgc-bridge-load-"))
    os.chmod(work, 0o700)
    tls = make_tls(work, ["127.0.0.1", "localhost"])  # the deployment's own CA and certificate
    ca, cert, key = tls.ca_cert, tls.server_cert, tls.server_key
    tokens = {f"phone-{i:04d}": f"token-{i:04d}-" + os.urandom(8).hex()
              for i in range(args.phones)}
    devices = work / "devices.json"
    devices.write_text(json.dumps(tokens))
    bridge, port = _start_bridge(work / "bridge", devices, cert, key)
    sampler = RssSampler(bridge.pid)
    sampler.start()
    time.sleep(1.0)
    sampler.mark("idle")
    time.sleep(1.0)
    idle_kib = sampler.now()
    procs = []
    share = -(-args.phones // args.procs)
    started = time.monotonic()
    try:
        for i in range(args.procs):
            first = i * share
            count = min(share, args.phones - first)
            if count <= 0:
                break
            out = work / f"phones-{i}.json"
            procs.append((subprocess.Popen(
                [sys.executable, __file__, "--phone-worker", "--port", str(port), "--ca",
                 str(ca), "--devices", str(devices), "--first", str(first), "--count",
                 str(count), "--out", str(out), "--rounds", str(args.rounds), "--update",
                 args.update, "--chunk-bytes", str(args.chunk_bytes), "--cut", str(args.cut),
                 "--rejoin", str(args.rejoin), "--train-s", *map(str, args.train_s),
                 "--ramp-s", str(args.ramp_s), "--seed", str(args.seed)], cwd=ROOT), out))
        sampler.mark("phones connecting")
        deadline = time.monotonic() + args.ramp_s + 300
        while (not all(Path(f"{out}.ready").exists() for _, out in procs)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        connect_s = time.monotonic() - started
        sampler.mark("connected")
        time.sleep(2.0)
        connected_kib = sampler.now()
        control = f"unix:{work / 'bridge' / 'control' / 'bridge.sock'}"
        fed = asyncio.run(_federation(args, control, list(tokens), sampler))
        sampler.mark("after the rounds")
        for proc, _ in procs:
            proc.wait(timeout=600)
        sampler.mark("phones gone")
        time.sleep(1.5)
        gone_kib = sampler.now()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        bridge.terminate()
        bridge.wait(timeout=30)
        sampler.stopped.set()
    wall = time.monotonic() - started
    phones: dict[str, Any] = {"latency": {}, "counts": {}, "uploads": [], "errors": []}
    for _, out in procs:
        got = json.loads(out.read_text()) if out.exists() else {"errors": [f"{out}: no output"]}
        for kind, values in got.get("latency", {}).items():
            phones["latency"].setdefault(kind, []).extend(values)
        for what, n in got.get("counts", {}).items():
            phones["counts"][what] = phones["counts"].get(what, 0) + n
        phones["uploads"] += got.get("uploads", [])
        phones["errors"] += got.get("errors", [])
    sent = {(u["device"], u["task_id"]): u for u in phones["uploads"]}
    back = {(r["device"], r["task_id"]): r for r in fed["results"]}
    expected = args.phones * args.rounds
    lost = expected - sum(1 for k, r in back.items() if k in sent
                          and sent[k]["sha256"] == r["sha256"])
    not_delivered = [u for u in phones["uploads"] if u["state"] != "DELIVERED"]
    rounds_peak = max((v for k, s in sampler.samples.items() if k.startswith("round")
                       for v in s), default=0)
    row = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "phones": args.phones, "rounds": args.rounds, "procs": args.procs,
        "update": args.update, "update_bytes": _example_update_bytes(args.update),
        "chunk_bytes": args.chunk_bytes,
        "cut": args.cut, "rejoin": args.rejoin, "train_s": list(args.train_s),
        "wall_s": wall, "connect_s": connect_s,
        "round_s": [r["seconds"] for r in fed["rounds"]],
        "rss_mib": {"idle": idle_kib / 1024, "connected": connected_kib / 1024,
                    "rounds_peak": rounds_peak / 1024,
                    "after_each_round": [r["rss_kib"] / 1024 for r in fed["rounds"]],
                    "phones_gone": gone_kib / 1024},
        "latency": {k: _percentiles(v) for k, v in sorted(phones["latency"].items())},
        "run_task": _percentiles(fed["latency"]),
        "counts": phones["counts"], "expected_updates": expected,
        "updates_back": len(back), "lost": lost, "not_delivered": len(not_delivered),
        "phone_errors": phones["errors"][:10], "phone_error_count": len(phones["errors"]),
        "federation_failures": fed["failures"][:10],
        "federation_failure_count": len(fed["failures"]),
    }
    print(json.dumps(row, indent=1))
    if args.jsonl:
        with open(args.jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0 if lost == 0 and not not_delivered else 1


if __name__ == "__main__":
    raise SystemExit(main())
