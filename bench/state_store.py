"""Client state store: the read and write cost per client of a 1M-parameter model's record.

A ``dgc`` client reads its record once and writes it once per round. The record is what
``client.app`` writes for an MLP 784-1262-10 (1,003,300 parameters): the compressor's state
(``DGCCompressor`` residual and momentum, from two real ``compress`` calls), the pending update
as wire bytes, and the held model (kept with ``downlink=auto``, the default). Timed, in turns so
that every backend sees the same background load:

- ``memory``: ``encode_record`` into one bytes object and ``decode_record`` of it: the
  serialisation any backend pays (the baseline of the ratios);
- ``folder <path>``: :class:`client.state.ClientStateStore` ``put``/``get`` in a folder (the
  default store); ``--folders`` names the folders (a shared mount, NFS, on a real cluster);
- ``redis``: the same bytes ``SET``/``GET`` on a ``redis-server`` started here on loopback
  (skipped when ``redis-server`` is not installed; ``apt-get install redis-server``), spoken
  to in RESP over one TCP socket, as a client library does.

Run: ``python bench/state_store.py [--folders DIR ...] [--repeats N]`` (under a minute).
"""

from __future__ import annotations

import argparse
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleaved_wall_cpu_ms, machine_line  # noqa: E402
from client.state import ClientStateStore, decode_record, encode_record  # noqa: E402
from fedgc.settings import RunConfig  # noqa: E402

HIDDEN = 1262  # 784 * 1262 + 1262 + 1262 * 10 + 10 = 1,003,300 parameters


def model_state(seed: int) -> OrderedDict[str, torch.Tensor]:
    """MLP 784-HIDDEN-10 with PyTorch's default initialisation bounds."""
    g = torch.Generator().manual_seed(seed)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, fan_in, fan_out in (("fc1", 784, HIDDEN), ("fc2", HIDDEN, 10)):
        bound = 1.0 / math.sqrt(fan_in)
        out[f"{name}.weight"] = (torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound
        out[f"{name}.bias"] = (torch.rand(fan_out, generator=g) * 2 - 1) * bound
    return out


def client_record(seed: int) -> dict:
    """The record ``client.app`` writes after a client's second round (default settings)."""
    import dgc

    model = model_state(seed)
    run = RunConfig.from_flat({"method": "dgc", "run_name": "bench"})
    compressor = run.method.compressor(run.train, 0)
    g = torch.Generator().manual_seed(seed + 1)
    update = None
    for rnd in (1, 2):
        grad = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in model.items()}
        update = compressor.compress(grad, epoch=float(rnd - 1), sequence=rnd)
    data = dgc.encode(update)
    return {"compressor": compressor.state_dict(),
            "pending": torch.frombuffer(bytearray(data), dtype=torch.uint8),
            "model": model, "model_version": 1,
            "reply": {"sequence": 2, "model_version": 1, "client_key": 0}}


class Redis:
    """A ``redis-server`` on a free loopback port, without persistence, and one connection."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder = Path(tempfile.mkdtemp(prefix="fgredis"))
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb", buffering=1 << 20)

    def _command(self, *parts: bytes) -> None:
        head = b"*%d\r\n" % len(parts)
        for p in parts[:-1]:
            head += b"$%d\r\n%s\r\n" % (len(p), p)
        self.sock.sendall(head + b"$%d\r\n" % len(parts[-1]))
        self.sock.sendall(parts[-1])
        self.sock.sendall(b"\r\n")

    def set(self, key: bytes, value: bytes) -> None:
        self._command(b"SET", key, value)
        line = self.reader.readline()
        if line != b"+OK\r\n":
            raise RuntimeError(f"redis SET answered {line!r}")

    def get(self, key: bytes) -> bytearray:
        self._command(b"GET", key)
        line = self.reader.readline()
        if not line.startswith(b"$"):
            raise RuntimeError(f"redis GET answered {line!r}")
        data = bytearray(int(line[1:]))
        self.reader.readinto(data)
        self.reader.read(2)
        return data

    def close(self) -> None:
        self.sock.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folders", nargs="*", default=None,
                   help="folders to put the records in (default: one on /tmp's disk, /dev/shm)")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)

    record = client_record(0)
    blob = b"".join(bytes(b) for b in encode_record(record))
    nparams = sum(v.numel() for v in record["model"].values())
    print(machine_line(1))
    parts = {k: len(b"".join(bytes(b) for b in encode_record({k: record[k]}))) / 1e6
             for k in ("compressor", "model", "pending")}
    print(f"record of a {nparams:,}-parameter model: {len(blob) / 1e6:.2f} MB (compressor state "
          f"{parts['compressor']:.2f} MB, held model {parts['model']:.2f} MB, pending update "
          f"{parts['pending']:.3f} MB)")

    made: list[Path] = []
    folders = args.folders
    if folders is None:
        folders = [tempfile.mkdtemp(prefix="fgstore", dir="/var/tmp")]
        made.append(Path(folders[0]))
        if Path("/dev/shm").is_dir():
            folders.append(tempfile.mkdtemp(prefix="fgstore", dir="/dev/shm"))
            made.append(Path(folders[1]))
    write = {"memory": lambda: b"".join(bytes(b) for b in encode_record(record))}
    read = {"memory": lambda: decode_record(bytearray(blob))}
    for folder in folders:
        store = ClientStateStore(folder)
        write[f"folder {folder}"] = lambda s=store: s.put("0", record)
        read[f"folder {folder}"] = lambda s=store: s.get("0")
    redis = Redis() if shutil.which("redis-server") else None
    if redis is not None:
        write["redis (loopback)"] = lambda: redis.set(b"0", b"".join(
            bytes(b) for b in encode_record(record)))
        read["redis (loopback)"] = lambda: decode_record(redis.get(b"0"))
    else:
        print("redis: skipped (no redis-server; apt-get install redis-server)")
    try:
        for fn in write.values():
            fn()  # every backend holds the record before reads are timed
        times_w = interleaved_wall_cpu_ms(write, repeats=args.repeats)
        times_r = interleaved_wall_cpu_ms(read, repeats=args.repeats)
    finally:
        if redis is not None:
            redis.close()
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
    base_w, base_r = times_w["memory"][0], times_r["memory"][0]
    width = max(map(len, write))
    print(f"{'backend':<{width}}  write ms  (x memory)   read ms  (x memory)  "
          f"per round ms  MB/s (write+read)")
    for name in write:
        w, r = times_w[name][0], times_r[name][0]
        print(f"{name:<{width}}  {w:8.1f}  ({w / base_w:6.2f}x)  {r:8.1f}  ({r / base_r:6.2f}x)"
              f"  {w + r:12.1f}  {2 * len(blob) / 1e3 / (w + r):8.0f}")


if __name__ == "__main__":
    main()
