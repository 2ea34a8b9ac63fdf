"""What the emulated arm64 phone runs: ``python -m android_bridge.arm.inside COMMAND JOB``.

Every command reads its inputs from the folder ``JOB`` (written by the host: ``.pte`` files,
gradients and batches as ``.npz``, a ``job.json``) and writes its results there as ``.npz`` /
``.json``, so the host compares them with what it computed itself. One process runs a whole
command: under emulation the imports alone take about a minute.

Commands
--------
``encode``  the host-exported ``encoder.pte`` of every case through ``PteEncoder`` over the
            case's steps (``restore`` after the step the case names).
``train``   ``train_step.pte`` with ExecuTorch's SGD from the given parameters over the batches.
``export``  ``export_encoder`` and ``export_training_step`` on aarch64 (the ``.pte`` bytes).
``memory``  peak resident memory of the encoder and the training step per size.
``phones``  reference phones (threads) that join a bridge on the host's loopback for N rounds.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _bits(values: np.ndarray) -> np.ndarray:
    """Raw bit patterns of float32 / 16-bit float values (so -0.0 and NaN payloads compare)."""
    return values.view(np.int16 if values.dtype.itemsize == 2 else np.int32)


def update_arrays(update: Any, prefix: str) -> dict[str, np.ndarray]:
    """``{prefix/name/indices|values_bits|values_dtype}`` of a ``dgc.SparseUpdate``."""
    import torch

    out = {}
    for name, t in update.tensors.items():
        values = t.values
        if values.dtype == torch.bfloat16:
            raw = values.view(torch.int16).numpy()
        else:
            raw = _bits(values.numpy())
        out[f"{prefix}/{name}/indices"] = t.indices.numpy().astype(np.int64)
        out[f"{prefix}/{name}/values_bits"] = raw
    return out


def encode(job: Path) -> None:
    """Every case of ``job.json``: its steps through ``PteEncoder``; updates and state saved."""
    # Imported per command: under emulation every import is start-up time (a minute for all).
    from android_bridge.runtime import PteEncoder
    from dgc.config import DGCConfig

    spec = json.loads((job / "job.json").read_text())
    for case in spec["cases"]:
        config = DGCConfig.from_dict(case["config"])
        shapes = {k: tuple(v) for k, v in case["shapes"].items()}
        pte = PteEncoder(job / case["pte"], config, shapes)
        out: dict[str, np.ndarray] = {}
        for step, epoch in enumerate(case["epochs"]):
            grads = dict(np.load(job / f"{case['name']}-grads-{step}.npz"))
            update = pte.compress(grads, epoch=epoch)
            out.update(update_arrays(update, f"{step}"))
            if step == case.get("restore_after"):
                pte.restore(update)
            for name in shapes:
                out[f"{step}/{name}/v"] = pte.v[name].numpy().copy()
                if config.momentum_correction:
                    out[f"{step}/{name}/u"] = pte.u[name].numpy().copy()
        np.savez(job / f"{case['name']}-arm.npz", **out)


def train(job: Path) -> None:
    """``train_step.pte`` from ``init.npz`` over ``batches.npz``: parameters and losses."""
    # Imported per command: under emulation every import is start-up time (a minute for all).
    from android_bridge.runtime import PteTrainer

    spec = json.loads((job / "job.json").read_text())
    trainer = PteTrainer(job / spec["export"])
    trainer.set_parameters(dict(np.load(job / "init.npz")))
    batches = np.load(job / "batches.npz")
    pairs = [(batches["x"][i], batches["y"][i]) for i in range(len(batches["x"]))]
    losses = trainer.train(pairs)
    np.savez(job / "train-arm.npz", losses=np.asarray(losses, dtype=np.float64),
             **{f"param/{k}": v for k, v in trainer.parameters().items()})


def _flatc_through_qemu(job: Path) -> None:
    # exir serializes with the wheel's aarch64 flatc binary (a subprocess). qemu-user does not
    # follow exec into another aarch64 binary without binfmt_misc, which this environment does
    # not register, so a host shell script runs the same aarch64 flatc under qemu.
    from executorch.exir._serialize import _flatbuffer

    flatc = Path(_flatbuffer.__file__).parents[2] / "data" / "bin" / "flatc"
    rootfs, qemu, cpu = (os.environ["FEDGC_ARM_ROOTFS"], os.environ["FEDGC_ARM_QEMU"],
                         os.environ["FEDGC_ARM_CPU"])
    wrapper = job / "flatc-aarch64.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {qemu} -cpu {cpu} -L {rootfs} {rootfs}{flatc} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    _flatbuffer._flatc_cached_path = str(wrapper)


def export(job: Path) -> None:
    """The encoder of ``job.json``'s config and mlp-digits' training step, exported here."""
    # Imported per command: under emulation every import is start-up time (a minute for all).
    import torch

    from android_bridge.export import export_encoder, export_training_step
    from android_bridge.models import get_model
    from dgc.config import DGCConfig

    _flatc_through_qemu(job)
    spec = json.loads((job / "job.json").read_text())
    config = DGCConfig.from_dict(spec["config"])
    (job / "encoder-arm.pte").write_bytes(export_encoder(config, spec["max_numel"]))
    model_spec = get_model(spec["model"])
    torch.manual_seed(spec["seed"])
    model = model_spec.build()
    (job / "train_step-arm.pte").write_bytes(
        export_training_step(model_spec, model, spec["batch_size"]))


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Return freed heap to the kernel, then reset VmHWM (the peak RSS) to the current RSS, so
    the next peak is the next case's own (memory a previous case freed would otherwise be
    reused without showing in the RSS)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def memory(job: Path) -> None:
    """Peak RSS of the encoder (program load, first and a later sparse step over one tensor of
    ``numel`` entries) and of the training step (load, ``steps`` steps), each above the RSS the
    process held just before loading it. Measured on the qemu process: the emulated process
    plus what qemu allocates translating the code."""
    # Imported per command: under emulation every import is start-up time (a minute for all).
    import torch

    from android_bridge.runtime import PteEncoder, PteTrainer
    from dgc.config import DGCConfig

    spec = json.loads((job / "job.json").read_text())
    results = []
    # The runtime's first use (program loader, XNNPACK's initialisation, the first method's
    # kernels) costs once per process; a small throwaway encoder takes it, reported apart.
    first = spec["encoder"][0]
    _reset_peak()
    base = _rss_kib("VmRSS")
    warm = PteEncoder(job / first["pte"], DGCConfig.from_dict(first["config"]), {"w": (4, 1000)})
    warm.compress({"w": torch.ones(4, 1000)}, epoch=10.0)
    peak = _rss_kib("VmHWM")
    results.append({"what": "first use", "numel": 4000, "baseline_kib": base, "peak_kib": peak,
                    "extra_kib": peak - base})
    del warm
    for case in spec["encoder"]:
        config = DGCConfig.from_dict(case["config"])
        n = case["numel"]
        grad = torch.randn(n // 1000, 1000, generator=torch.Generator().manual_seed(0))
        _reset_peak()
        base = _rss_kib("VmRSS")
        pte = PteEncoder(job / case["pte"], config, {"w": tuple(grad.shape)})
        pte.compress({"w": grad}, epoch=10.0)
        pte.compress({"w": grad * 0.5}, epoch=10.0)
        peak = _rss_kib("VmHWM")
        results.append({"what": "encoder", "numel": n, "baseline_kib": base, "peak_kib": peak,
                        "extra_kib": peak - base})
        del pte
    for case in spec["train"]:
        _reset_peak()
        base = _rss_kib("VmRSS")
        trainer = PteTrainer(job / case["export"])
        batch = trainer.batch_shape
        x = np.zeros(batch, dtype=np.float32)
        y = np.zeros(batch[0], dtype=np.int64)
        trainer.train([(x, y)] * case["steps"])
        peak = _rss_kib("VmHWM")
        results.append({"what": "train_step", "numel": case["numel"], "baseline_kib": base,
                        "peak_kib": peak, "extra_kib": peak - base})
        del trainer
    (job / "memory-arm.json").write_text(json.dumps(
        {"machine": platform.machine(), "results": results}, indent=2) + "\n")


def phones(job: Path) -> None:
    """Reference phones (one thread each) that register with the bridge, say READY on stdout
    and run ``rounds`` rounds each; their reports go to ``phones-arm.json``."""
    # Imported per command: under emulation every import is start-up time (a minute for all).
    from android_bridge.phone import ReferencePhone

    spec = json.loads((job / "job.json").read_text())
    ca = (job / spec["ca"]).read_bytes()
    made = []
    for phone in spec["phones"]:
        data = np.load(job / phone["data"])
        made.append((phone, ReferencePhone(job / spec["export"], phone["device"], phone["token"],
                                           spec["target"], data["x"], data["y"],
                                           root_certificates=ca)))
    for _, p in made:
        p.register()
    print("READY", flush=True)
    reports: dict[str, list] = {}
    errors: list[str] = []

    def loop(phone: dict, p: ReferencePhone) -> None:
        try:
            got = reports.setdefault(phone["device"], [])
            while len(got) < spec["rounds"]:
                task = p.wait_for_task(spec["task_timeout_s"])
                cut = phone.get("cut_after_bytes") if task.server_round == phone.get(
                    "cut_round") else None
                r = p.run_round(task, cut_after_bytes=cut)
                got.append({"round": r.server_round, "uplink_bytes": r.uplink_bytes,
                            "downlink_bytes": len(task.model_bytes),
                            "resume_offsets": r.resume_offsets, "ack_state": r.ack_state,
                            "train_loss": r.train_loss})
        except Exception as ex:  # reported to the host
            errors.append(f"{phone['device']}: {type(ex).__name__}: {ex}")

    threads = [threading.Thread(target=loop, args=pair) for pair in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, p in made:
        p.close()
    (job / "phones-arm.json").write_text(json.dumps(
        {"machine": platform.machine(), "reports": reports, "errors": errors}, indent=2) + "\n")


COMMANDS = {"encode": encode, "train": train, "export": export, "memory": memory,
            "phones": phones}


def main(argv: list[str]) -> int:
    """``inside.py COMMAND[,COMMAND...] JOB``; prints the machine and the seconds it took."""
    names = argv[0].split(",") if argv else []
    if len(argv) != 2 or not names or any(n not in COMMANDS for n in names):
        print(f"usage: python -m android_bridge.arm.inside COMMAND[,COMMAND...] JOB, commands "
              f"{sorted(COMMANDS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    for name in names:
        COMMANDS[name](Path(argv[1]))
    print(f"{argv[0]} done on {platform.machine()} in {time.monotonic() - started:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
