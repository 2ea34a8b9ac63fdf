"""The exported encoder and training step, and the reference phone, on aarch64 (qemu-user).

Each test runs one emulated Python process (``android_bridge.arm.inside``) in the arm64 rootfs
that ``make arm`` builds, and compares what it wrote with what the host computes. Without the
rootfs these tests skip, unless ``FEDGC_ARM_REQUIRED=1`` (``make test`` sets it), where they fail.
Costs are in docs/android.md ("aarch64").
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from android_bridge.arm.emulator import ArmEnv, ArmEnvError
from android_bridge.export import TrainingStep, export_all, export_encoder
from android_bridge.models import get_model
from dgc import DGCCompressor, DGCConfig
from tests.test_android_export import CONFIGS, SHAPES, gradients

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
MAX_NUMEL = 8192
STEPS = 6


@pytest.fixture(scope="module")
def arm() -> ArmEnv:
    try:
        return ArmEnv.find()
    except ArmEnvError as ex:
        if os.environ.get("FEDGC_ARM_REQUIRED") == "1":
            pytest.fail(str(ex))
        pytest.skip(str(ex))


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy()
    return t.view(torch.int32).numpy()


def test_encoder_and_training_step_on_aarch64_match_the_host(arm, tmp_path):
    """x86-exported encoder.pte over four configs x six steps (warm-up, a zero-heavy tensor, a
    tied k-th magnitude, clipping on and off, a restore) and train_step.pte over 40 SGD steps,
    run on aarch64: the encoder bit-exact with dgc.DGCCompressor on the host, the trained
    parameters within the documented 1e-5."""
    job = tmp_path
    cases = []
    for name, config in CONFIGS.items():
        (job / f"{name}.pte").write_bytes(export_encoder(config, max_numel=MAX_NUMEL))
        epochs = [step * 0.75 for step in range(STEPS)]
        for step in range(STEPS):
            np.savez(job / f"{name}-grads-{step}.npz",
                     **{k: v.numpy() for k, v in gradients(step).items()})
        cases.append({"name": name, "pte": f"{name}.pte", "config": config.to_dict(),
                      "shapes": {k: list(v) for k, v in SHAPES.items()}, "epochs": epochs,
                      "restore_after": 2})
    # The training step: mlp-digits on scikit-learn's digits.
    from sklearn.datasets import load_digits

    export_all("mlp-digits", job / "export", DGCConfig(selection="exact"), batch_size=16,
               learning_rate=0.1, max_numel=MAX_NUMEL)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    torch.manual_seed(42)
    model = get_model("mlp-digits").build()
    np.savez(job / "init.npz", **{k: p.detach().numpy() for k, p in model.named_parameters()})
    batches_x = np.stack([x[i:i + 16] for i in range(0, 40 * 16, 16)])
    batches_y = np.stack([y[i:i + 16] for i in range(0, 40 * 16, 16)])
    np.savez(job / "batches.npz", x=batches_x, y=batches_y)
    (job / "job.json").write_text(json.dumps({"cases": cases, "export": "export"}))

    out = arm.run("-m", "android_bridge.arm.inside", "encode,train", str(job)).stdout
    assert "on aarch64" in out

    for case in cases:
        config = DGCConfig.from_dict(case["config"])
        got = np.load(job / f"{case['name']}-arm.npz")
        eager = DGCCompressor(config)
        for step, epoch in enumerate(case["epochs"]):
            want = eager.compress(gradients(step), epoch=epoch)
            for name, t in want.tensors.items():
                where = (case["name"], step, name)
                np.testing.assert_array_equal(got[f"{step}/{name}/indices"], t.indices.numpy(),
                                              err_msg=str(where))
                np.testing.assert_array_equal(got[f"{step}/{name}/values_bits"], _bits(t.values),
                                              err_msg=str(where))
            if step == case["restore_after"]:
                eager.restore(want)
            for name in SHAPES:
                np.testing.assert_array_equal(
                    got[f"{step}/{name}/v"].reshape(-1),
                    eager.memory.v[name].reshape(-1).numpy(), err_msg=f"v {case['name']} {step}")
                if config.momentum_correction:
                    np.testing.assert_array_equal(
                        got[f"{step}/{name}/u"].reshape(-1),
                        eager.memory.u[name].reshape(-1).numpy(), err_msg=f"u {case['name']}")

    trained = np.load(job / "train-arm.npz")
    eager_model = model
    opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    step_fn = TrainingStep(eager_model)
    losses = []
    for xb, yb in zip(batches_x, batches_y, strict=True):
        opt.zero_grad()
        loss, _ = step_fn(torch.from_numpy(xb), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    worst = 0.0
    for name, p in eager_model.named_parameters():
        diff = np.abs(trained[f"param/{name}"] - p.detach().numpy())
        worst = max(worst, float(diff.max()))
    np.testing.assert_allclose(trained["losses"], losses, rtol=0, atol=1e-5)
    assert worst <= 1e-5, worst
    print(f"aarch64 training step vs eager x86 SGD after 40 steps: max |diff| = {worst:.3g}")
