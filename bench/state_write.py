"""Cost of the fsync in fedgc.files.atomic_write on a client state write, in one run.

A dgc client writes its state record (residual, momentum, pending update, held model) every round
it trains. The store used to write the temporary file without fsync; ``fedgc.files.atomic_write``
syncs it before ``os.replace``, so that a power loss cannot leave an empty or torn record
behind the rename. This prints the time per record of both on the same records, in the same
folder, alternating, and their ratio:
``python bench/state_write.py [--mb 4] [--writes 20] [--repeats 3] [--dir results/bench]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from client.state import ClientStateStore, encode_record


def _write_without_fsync(root: Path, key: str, record: dict) -> None:
    """The store's write before fedgc.files: temporary file and os.replace, no fsync."""
    parts = encode_record(record)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=root)
    with os.fdopen(fd, "wb") as fh:
        for part in parts:
            fh.write(part)
    os.replace(tmp, root / f"{key}.state")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=4.0, help="record size in MB (float32 residual)")
    p.add_argument("--writes", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="results/bench_state_write")
    args = p.parse_args()
    root = Path(args.dir)
    store = ClientStateStore(root)
    record = {"compressor": {"v": torch.randn(int(args.mb * 250_000))}}
    ratios = []
    for rep in range(args.repeats):
        times = {}
        for name, write in (("no fsync", lambda k: _write_without_fsync(root, k, record)),
                            ("atomic_write", lambda k: store.put(k, record))):
            started = time.perf_counter()
            for i in range(args.writes):
                write(str(i % 5))
            times[name] = (time.perf_counter() - started) / args.writes
        ratios.append(times["atomic_write"] / times["no fsync"])
        print(f"repeat {rep}: no fsync {times['no fsync'] * 1e3:.1f} ms, atomic_write "
              f"{times['atomic_write'] * 1e3:.1f} ms per {args.mb:g} MB record, "
              f"ratio {ratios[-1]:.2f}x")
    print(f"mean ratio {sum(ratios) / len(ratios):.2f}x")
    for key in store.keys():
        store.delete(key)


if __name__ == "__main__":
    main()
