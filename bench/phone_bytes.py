"""Bytes a phone sends and receives per round in a default fedgc run (wire-format payloads).

``PYTHONPATH=. python bench/phone_bytes.py [--rounds 6]``: exports the federation's defaults
(``python -m android_bridge export`` with no options: the default task's model, its DGC config,
batch 10, lr 0.1), takes client 0 of the default partition (Dirichlet 0.5 over 100 clients),
and per round trains it with ``train_step.pte`` for the default ``local_epochs`` from the same
global model, compresses the pseudo-gradient with ``encoder.pte`` at that round's warm-up
density and encodes it (``dgc.encode``), as ``android_bridge.phone`` does. Received: the dense
float32 model the bridge sends (``SparseUpdate.from_dense(..., "float32")``), which a phone gets
every round it did not take part in the previous one (10 of 100 clients per round: nearly
always). gRPC/TLS framing and the per-chunk fields (ids, sha256, metrics) come on top. Bytes
depend on the model and density, not on the CPU: the aarch64 phone sent the same bytes as the
x86 one in tests/test_arm.py.
"""

from __future__ import annotations

import argparse
import math
import tempfile

import numpy as np
import torch

import dgc
from android_bridge.export import export_all, federation_defaults
from android_bridge.runtime import PteEncoder, PteTrainer
from dgc.sparse import SparseUpdate
from fedgc.settings import TrainSettings
from tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    s = TrainSettings()
    defaults = federation_defaults()
    out = tempfile.mkdtemp(prefix="phone-bytes-")
    manifest = export_all(None, out, max_numel=2**20)
    task = get_task(s.task)
    idx = task.partition(s.num_clients, scheme=s.partition, alpha=s.alpha, seed=s.seed)[0]
    x, y = task.train_x[idx].numpy(), task.train_y[idx].numpy()
    torch.manual_seed(0)
    model = {k: p.detach().numpy().copy() for k, p in task.build_model().named_parameters()}
    dense = dgc.encode(SparseUpdate.from_dense({k: torch.from_numpy(v) for k, v in model.items()},
                                               "float32", 0))
    trainer, encoder = PteTrainer(out), PteEncoder.from_export(out)
    batch = defaults["batch_size"]
    steps = s.local_epochs * math.ceil(len(x) / batch)
    numel = sum(p["numel"] for p in manifest["parameters"])
    print(f"task {s.task}: {numel} parameters, client 0 holds {len(x)} examples, "
          f"{steps} local steps of batch {batch}")
    print(f"{'round':>5} {'density':>8} {'sent B':>8} {'received B':>10} {'sent/dense fp32':>15}")
    rng = np.random.default_rng(0)
    for r in range(1, args.rounds + 1):
        trainer.set_parameters(model)
        order = rng.permutation(np.resize(np.arange(len(x)), steps * batch))
        trainer.train((x[order[i:i + batch]], y[order[i:i + batch]])
                      for i in range(0, steps * batch, batch))
        local = trainer.parameters()
        update = encoder.compress({k: model[k] - local[k] for k in model}, epoch=float(r - 1),
                                  sequence=r)
        sent = len(dgc.encode(update))
        print(f"{r:>5} {defaults['config'].density_at(r - 1):>8.4f} {sent:>8} {len(dense):>10} "
              f"{sent / len(dense):>15.4f}")


if __name__ == "__main__":
    main()
