"""Peak memory of the exported encoder and training step on the emulated arm64 phone vs x86.

``PYTHONPATH=. python bench/arm_memory.py`` (needs ``make arm``): exports the encoder (default
DGC config, ``max_numel`` = the size measured) and training steps of two MLPs (~1e5 and ~1e6
parameters, batch 10), then
runs ``android_bridge.arm.inside memory`` once natively on this x86 host and once on aarch64
under qemu-user, and prints the peak resident memory above the RSS held just before loading the
program (VmHWM after a reset, minus VmRSS then) for loading the encoder and two sparse steps over
a 1e5 / 1e6-entry tensor, and for loading the training step and 5 steps. The qemu figure
includes what qemu itself allocates while translating the code; both are the process's own
view, not a phone's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from android_bridge.arm.emulator import REPO, ArmEnv
from android_bridge.export import export_encoder, export_training_step
from android_bridge.models import MLP, ModelSpec
from dgc import DGCConfig

SIZES = {100_000: 128, 1_000_000: 1262}  # MLP(784, hidden, 10): 101,770 and 1,003,300 params


def main() -> None:
    env = ArmEnv.find()
    job = Path(tempfile.mkdtemp(prefix="arm-memory-"))
    config = DGCConfig(selection="exact")
    # ExecuTorch plans the encoder's memory for the longest tensor it accepts (max_numel), so
    # each size gets its own export with max_numel = that size, as a phone's export would.
    for n in SIZES:
        (job / f"encoder-{n}.pte").write_bytes(export_encoder(config, max_numel=n))
    train = []
    for target, hidden in SIZES.items():
        spec = ModelSpec(f"mlp-{hidden}", lambda h=hidden: MLP(784, h, 10), (784,), 10)
        torch.manual_seed(0)
        model = spec.build()
        numel = sum(p.numel() for p in model.parameters())
        folder = job / f"train-{target}"
        folder.mkdir()
        (folder / "train_step.pte").write_bytes(export_training_step(spec, model, 10))
        (folder / "manifest.json").write_text(json.dumps({
            "parameters": [{"name": n, "shape": list(p.shape)}
                           for n, p in model.named_parameters()],
            "training": {"file": "train_step.pte", "parameter_prefix": "net.",
                         "batch_size": 10, "input_shape": [10, 784], "learning_rate": 0.1}}))
        train.append({"export": folder.name, "numel": numel, "steps": 5})
    (job / "job.json").write_text(json.dumps({
        "encoder": [{"pte": f"encoder-{n}.pte", "config": config.to_dict(), "numel": n}
                    for n in SIZES],
        "train": train}))
    sizes = {str(p.relative_to(job)): p.stat().st_size for p in sorted(job.rglob("*.pte"))}
    print("pte sizes (bytes):", json.dumps(sizes))
    host = job.with_name(job.name + "-x86")
    shutil.copytree(job, host)
    subprocess.run([sys.executable, "-m", "android_bridge.arm.inside", "memory", str(host)],
                   check=True, cwd=REPO)
    env.run("-m", "android_bridge.arm.inside", "memory", str(job))
    x86 = json.loads((host / "memory-arm.json").read_text())  # inside.py's name for its output
    arm = json.loads((job / "memory-arm.json").read_text())
    print(f"{'what':>10} {'params':>9} {'x86 MiB':>8} {'aarch64 MiB':>11} "
          f"{'baseline MiB x86/aarch64':>24}")
    for a, b in zip(x86["results"], arm["results"], strict=True):
        print(f"{a['what']:>10} {a['numel']:>9} {a['extra_kib'] / 1024:8.1f} "
              f"{b['extra_kib'] / 1024:11.1f} "
              f"{a['baseline_kib'] / 1024:>15.0f} / {b['baseline_kib'] / 1024:.0f}")
    shutil.rmtree(job)
    shutil.rmtree(host)


if __name__ == "__main__":
    main()
