"""Benchmark of secure aggregation (fedgc.privacy.secagg): CPU time and bytes of a SecAgg+ session.

For ``n`` clients (10, 100) and vectors of ``L`` coordinates (1e3, 1e4, 1e5), each session run
in this process (``fedgc.privacy.secagg.local.run_local``: every client's handler and the server,
messages passed by hand, no transport), prints a markdown table of

- the CPU seconds of one client (mean over the clients) and of the server, per stage and in all;
- the bytes of one client's messages (its requests and its replies; payload, not transport), in
  all and the masked vector alone, and the ratio of the whole to the vector's plain payload
  (``L`` float32 values, ``4 L`` bytes);

with the fixed point's modulus for ``n`` clients of 16-bit values and the default neighbours
(``n - 1`` for 10 clients, 28 for 100). Then the server's cost of recovering dropouts (10% of
the clients dropping before their masked vector, whose pairwise masks the server rebuilds), and
how often a session of 100 clients ends without a sum when each client drops at each stage with
probability ``p`` (``--trials`` sessions per ``p``).

Run from the repository root (one core: through ``/work/locks/cpujob`` on the shared machine)::

    PYTHONPATH=. python bench/secagg.py [--clients 10 100] [--lengths 1000 10000 100000]
        [--trials 10] [--json results/secagg.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import numpy as np

from fedgc.privacy import FixedPoint
from fedgc.privacy.secagg import default_neighbours, default_threshold
from fedgc.privacy.secagg.cost import STAGES, client_bytes
from fedgc.privacy.secagg.local import LocalRun, run_local

SERVER_STEPS = (*STAGES, "result")


def _session(clients: int, length: int, drop: dict[int, str] | None = None,
             seed: int = 0) -> tuple[LocalRun, FixedPoint]:
    fp = FixedPoint.for_clients(clients, clip=1.0, value_bits=16)
    rng = np.random.default_rng(seed)
    vectors = {c: fp.encode(rng.uniform(-1, 1, length), rng)[0] for c in range(clients)}
    return run_local(vectors, fp.modulus_bits, drop=drop, rng=random.Random(seed)), fp


def bench_sizes(clients_list: list[int], lengths: list[int]) -> list[dict]:
    rows = []
    print("| n | k | t | L | bits | client CPU s (setup/share/masked/unmask) | client s | "
          "server CPU s (setup/share/masked/unmask/result) | server s | client bytes | "
          "masked vector | overhead | / (4 L) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in clients_list:
        for length in lengths:
            run, fp = _session(n, length)
            assert run.error is None, run.error
            k = default_neighbours(n)
            per_client = [run.client_seconds[s] / n for s in STAGES]
            server = [run.server_seconds.get(s, 0.0) for s in SERVER_STEPS]
            stages = client_bytes(k, length, fp.modulus_bits)
            assert all(run.bytes[c] == stages for c in run.bytes)  # the model is the messages
            total = sum(b.down + b.up for b in stages.values())
            vector = stages["collect_masked_vectors"].up
            row = {"clients": n, "neighbours": k, "threshold": default_threshold(k),
                   "length": length, "modulus_bits": fp.modulus_bits,
                   "client_cpu_s": per_client, "server_cpu_s": server,
                   "client_bytes": total, "masked_vector_bytes": vector,
                   "overhead_bytes": total - vector, "plain_payload_bytes": 4 * length}
            rows.append(row)
            print(f"| {n} | {k} | {row['threshold']} | {length:,} | {fp.modulus_bits} | "
                  f"{'/'.join(f'{s:.3f}' for s in per_client)} | {sum(per_client):.3f} | "
                  f"{'/'.join(f'{s:.3f}' for s in server)} | {sum(server):.2f} | "
                  f"{total:,} | {vector:,} | {total - vector:,} | {total / (4 * length):.2f} |",
                  flush=True)
    return rows


def bench_recovery(clients: int, length: int) -> dict:
    dropped = {c: "collect_masked_vectors" for c in range(0, clients, 10)}
    run, _ = _session(clients, length, dropped, seed=1)
    base, _ = _session(clients, length, seed=1)
    assert run.error is None and base.error is None
    row = {"clients": clients, "length": length, "dropped": len(dropped),
           "server_result_cpu_s": run.server_seconds["result"],
           "server_result_cpu_s_no_dropout": base.server_seconds["result"]}
    print(f"\nRecovery, n = {clients}, L = {length:,}: {len(dropped)} clients drop before their "
          f"masked vector; the server's unmasking takes {row['server_result_cpu_s']:.2f} s CPU "
          f"(no dropout: {row['server_result_cpu_s_no_dropout']:.2f} s).", flush=True)
    return row


def bench_failures(clients: int, rates: list[float], trials: int) -> list[dict]:
    rows = []
    print(f"\nSessions of {clients} clients (k = {default_neighbours(clients)}, t = "
          f"{default_threshold(default_neighbours(clients))}) ending without a sum when each "
          f"client drops at each stage with probability p ({trials} sessions per p):")
    print("| p | dropped at some stage (mean) | sessions without a sum | mean summed |")
    print("|---|---|---|---|")
    for p in rates:
        failed, summed, gone = 0, [], []
        for trial in range(trials):
            rng = random.Random(1000 * trial + int(p * 1000))
            drop = {}
            for c in range(clients):
                for stage in STAGES:
                    if rng.random() < p:
                        drop[c] = stage
                        break
            run, _ = _session(clients, 10, drop, seed=trial)
            gone.append(len(drop))
            if run.error is not None:
                failed += 1
            else:
                summed.append(len(run.session.summed))
        row = {"p": p, "dropped_mean": float(np.mean(gone)), "failed": failed,
               "trials": trials, "summed_mean": float(np.mean(summed)) if summed else 0.0}
        rows.append(row)
        print(f"| {p} | {row['dropped_mean']:.1f} | {failed} of {trials} | "
              f"{row['summed_mean']:.1f} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"# SecAgg+ session, {platform.machine()}, {time.strftime('%Y-%m-%d')}, "
          f"one process (CPU seconds: process time)\n")
    out = {"sizes": bench_sizes(args.clients, args.lengths),
           "recovery": bench_recovery(max(args.clients), 10000)}
    if args.trials:
        out["failures"] = bench_failures(max(args.clients), args.rates, args.trials)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
