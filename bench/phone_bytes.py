"""Bytes a phone sends and receives per round of a default fedgc run (wire-format payloads).

``PYTHONPATH=. python bench/phone_bytes.py [--rounds 5] [--clients 10]``: a default run's keys
(``fedgc.settings``: the default task, ``dgc``, no warm-up, client momentum, the second density
for small tensors, the sign channel, int8 patches broadcast) with ``--clients`` clients, all of
them in every round, so that client 0, a reference phone (``android_bridge.phone``: ExecuTorch
``train_step.pte`` and ``encoder.pte``, exported for the run), takes part every round. The
federation runs in this process (``server.local_grid.LocalGrid``): the other clients are
``client.app``, the phone is served through the bridge (plaintext loopback). Printed per round:
what the phone received (the dense model, or a patch on the version it holds) and what it sent
(the DGC update, the signs answering the round's shared index sets), beside the dense float32
model. gRPC/TLS framing and the per-chunk fields come on top (docs/wire.md measures them).
Bytes depend on the model, the data and the densities, not on the CPU: the aarch64 phone sends
the x86 phone's bytes (tests/test_arm.py).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch

import dgc
from android_bridge.bridge import PhoneBridge
from android_bridge.bridge_app import make_bridge_app
from android_bridge.export import export_run
from android_bridge.phone import ReferencePhone
from android_bridge.proto import fedgc_bridge_pb2 as pb
from client.app import app as client_app
from client.app import client_data, client_key
from dgc.sparse import SparseUpdate
from fedgc.settings import RunConfig
from fedgc.task_loader import load_task
from server.app import run_server
from server.local_grid import LocalGrid

DEVICE, TOKEN = "phone-0", "t" * 16 + "-bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="phone-bytes-")
    config = RunConfig.from_flat({"num_clients": args.clients,
                                  "clients_per_round": args.clients, "rounds": args.rounds,
                                  "progress": False, "results_dir": out, "run_name": "run"})
    t = config.train
    started = time.monotonic()
    manifest = export_run(config, f"{out}/export")
    print(f"exported in {time.monotonic() - started:.0f} s")
    x, y = client_data(t, 0, None)
    rows: list[tuple[int, int, str, int, int]] = []
    stop = threading.Event()
    with PhoneBridge({DEVICE: TOKEN}, "127.0.0.1:0") as bridge:
        phone = ReferencePhone(f"{out}/export", DEVICE, TOKEN, f"127.0.0.1:{bridge.port}",
                               x.numpy(), y.numpy())

        def serve() -> None:
            phone.register()
            while not stop.is_set():
                try:
                    task = phone.wait_for_task(0.5)
                except TimeoutError:
                    continue
                report = phone.run_round(task)
                kind = "patch" if task.encoding == pb.SPARSE_PATCH else "dense"
                rows.append((report.server_round, len(task.model_bytes), kind,
                             report.uplink_bytes - report.side_bytes, report.side_bytes))

        worker = threading.Thread(target=serve, daemon=True)
        worker.start()
        phones = make_bridge_app(bridge, {0: DEVICE}, timeout_s=600)

        def app(msg, context):  # type: ignore[no-untyped-def]
            return (phones if client_key(context) == 0 else client_app)(msg, context)

        summary = run_server(LocalGrid(app, t.num_clients, seed=1), config)
        stop.set()
        worker.join(10)
        phone.close()
    torch.manual_seed(t.seed)
    model = {k: v.detach() for k, v in load_task(t.task_spec()).build_model().state_dict().items()}
    numel = sum(p["numel"] for p in manifest["parameters"])
    dense = len(dgc.encode(SparseUpdate.from_dense(model, "float32", 0)))
    print(f"task {t.task}: {numel:,} parameters (dense float32 model {dense:,} B); the phone "
          f"holds {len(x)} examples; {args.clients} clients, all in every round; final "
          f"accuracy {summary['final_accuracy']:.3f}")
    print(f"{'round':>5} {'received B':>11} {'':<6} {'update B':>9} {'signs B':>8} "
          f"{'sent B':>7} {'sent/dense':>10} {'received/dense':>14}")
    for r, received, kind, update, signs in rows:
        print(f"{r:>5} {received:>11,} {kind:<6} {update:>9,} {signs:>8,} {update + signs:>7,} "
              f"{(update + signs) / dense:>10.4f} {received / dense:>14.4f}")


if __name__ == "__main__":
    main()
