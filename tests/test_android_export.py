"""Exported encoder and training step: parity of the ExecuTorch programs with eager dgc/torch."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from android_bridge.encoder import DenseStepEncoder, SparseStepEncoder, check_compatible
from android_bridge.export import (
    TrainingStep,
    export_all,
    export_encoder,
    export_torchscript,
)
from android_bridge.models import get_model
from android_bridge.runtime import PteEncoder, PteTrainer, load_manifest
from dgc import Compressor, ConfigError, DGCCompressor, DGCConfig, StateError
from dgc.selection import num_selected

torch.set_num_threads(1)

SHAPES = {"w1": (64, 50), "w2": (40, 30), "w3": (7000,), "bias": (50,), "small": (10, 10)}
# w3 is 1-D, hence dense by the layer policy; make one long 2-D tensor too.
SHAPES["w4"] = (100, 70)
# w5: few distinct values, so the k-th largest magnitude is tied: encode_blocked must fall back
# to topk over the whole tensor to pick the tied entries eager torch.topk picks.
SHAPES["w5"] = (50, 64)
MAX_NUMEL = 8192

CONFIGS = {
    "default": DGCConfig(selection="exact"),
    "nesterov-dampened-clipped": DGCConfig(selection="exact", nesterov=True, dampening=0.5,
                                           clip_norm=2.0, num_workers=4, density=0.01),
    "plain-ef-fp32": DGCConfig(selection="exact", momentum_correction=False,
                               value_dtype="float32", density=0.02, warmup="none"),
    # dampening 0.3: torch.add(..., alpha=0.7) takes the float64 fused-multiply-add path.
    "no-ef-bf16-nomask": DGCConfig(selection="exact", error_feedback=False,
                                   momentum_masking=False, value_dtype="bfloat16",
                                   clip_norm=0.5, density=0.005, dampening=0.3),
}


def gradients(step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded gradients with varied scales and a sparse tensor full of exact zeros."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        g = torch.randn(shape, generator=gen) * (0.1 * (i + 1))
        out[name] = g
    # w2: only 20 non-zero entries, fewer than k during warm-up, so zero entries must be dropped.
    mask = torch.zeros(math.prod(SHAPES["w2"]))
    mask[torch.randperm(mask.numel(), generator=gen)[:20]] = 1.0
    out["w2"] = out["w2"] * mask.view(SHAPES["w2"])
    out["w5"] = torch.randint(-3, 4, SHAPES["w5"], generator=gen).float() * 0.25
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory, encoder_pte):
    config = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "encoder.pte"
    path.write_bytes(encoder_pte(request.param))
    return config, path


def assert_same_update(got, want) -> None:
    assert list(got.tensors) == list(want.tensors)
    for name, w in want.tensors.items():
        g = got.tensors[name]
        assert g.shape == w.shape, name
        assert torch.equal(g.indices, w.indices), name
        assert g.values.dtype == w.values.dtype, name
        # Bitwise: compare the raw bits, so that -0.0 vs 0.0 or NaN patterns would show.
        assert torch.equal(g.values.view(torch.int16 if g.values.element_size() == 2
                                         else torch.int32),
                           w.values.view(torch.int16 if w.values.element_size() == 2
                                         else torch.int32)), name


def test_pte_encoder_matches_dgc_bit_for_bit(exported):
    config, path = exported
    pte = PteEncoder(path, config, SHAPES)
    eager = DGCCompressor(config)
    selected_any = dropped_zeros = False
    for step in range(6):
        grads = gradients(step)
        epoch = step * 0.75  # crosses warm-up epochs: k changes between steps
        want = eager.compress(grads, epoch=epoch)
        got = pte.compress(grads, epoch=epoch)
        assert got.sequence == want.sequence
        assert_same_update(got, want)
        for name in SHAPES:
            assert torch.equal(pte.v[name], eager.memory.v[name]), (step, name)
            if config.momentum_correction:
                assert torch.equal(pte.u[name], eager.memory.u[name]), (step, name)
        selected_any |= 0 < want.tensors["w1"].nnz < math.prod(SHAPES["w1"])
        k_w2 = num_selected(math.prod(SHAPES["w2"]), config.density_at(epoch))
        dropped_zeros |= want.tensors["w2"].nnz < k_w2
    assert selected_any
    assert dropped_zeros  # the zero-heavy tensor exercised the zero-dropping path


def test_sum_squares_agrees_with_float64(exported):
    """The split float32 sum of squares, and its float64 fallback for huge entries, agree with
    eager float64 to the last bits of a float64 sum."""
    from executorch.runtime import Runtime

    _, path = exported
    method = Runtime.get().load_program(path).load_method("sum_squares")
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(MAX_NUMEL, generator=gen) * 3, torch.randn(777, generator=gen) * 1e-20,
             torch.tensor([1e30, -2.5, 0.0]), torch.tensor([3.0e19, 1.0]),
             torch.tensor([float(2**62), 1.0])]
    for g in cases:
        want = float(g.double().pow(2).sum())
        got = float(method.execute((g,))[0])
        # products under float32's normal range may each lose up to 2**-126 (documented)
        assert abs(got - want) <= 1e-13 * want + 3 * g.numel() * 2.0**-126, (g[:3], got, want)


def test_torchscript_matches_eager_modules(exported, tmp_path):
    config, _ = exported
    path = tmp_path / "encoder.pt"
    export_torchscript(config, path)
    scripted = torch.jit.load(str(path))
    sparse, dense = SparseStepEncoder(config), DenseStepEncoder(config)
    gen = torch.Generator().manual_seed(3)
    n = 3000
    u, v = torch.zeros(n), torch.zeros(n)
    su, sv = u, v
    scale = torch.tensor([0.75])
    for step in range(3):
        g = torch.randn(n, generator=gen)
        fresh = torch.tensor([1.0 if step == 0 else 0.0])
        want = sparse(g, u, v, scale, fresh, torch.zeros(30))
        got = scripted(g, su, sv, scale, fresh, torch.zeros(30))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        u, v, su, sv = want[3], want[4], got[3], got[4]
    g = torch.randn(50, generator=gen)
    for a, b in zip(scripted.encode_dense(g, g * 0 + 1, g * 0, scale, torch.zeros(1)),
                    dense(g, g * 0 + 1, g * 0, scale, torch.zeros(1)), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(scripted.sum_squares(g), g.double().pow(2).sum())


def test_pte_encoder_rejects_bad_gradients_and_keeps_state(exported):
    config, path = exported
    pte = PteEncoder(path, config, SHAPES)
    pte.compress(gradients(0))
    before = pte.state_dict()
    bad = gradients(1)
    bad["w1"] = bad["w1"].clone()
    bad["w1"][3, 4] = float("nan")
    with pytest.raises(StateError, match="'w1' contains NaN"):
        pte.compress(bad)
    with pytest.raises(StateError, match="'nope' is not a parameter"):
        pte.compress({"nope": torch.zeros(3)})
    with pytest.raises(StateError, match="'w2' has 5 entries, the residual holds 1200"):
        pte.compress({"w2": torch.zeros(5)})
    with pytest.raises(StateError, match="must be floating point"):
        pte.compress({"w1": torch.zeros(SHAPES["w1"], dtype=torch.int64)})
    after = pte.state_dict()
    assert after["step"] == before["step"]
    for part in ("u", "v"):
        assert set(after[part]) == set(before[part])
        for name in before[part]:
            np.testing.assert_array_equal(after[part][name], before[part][name])


def test_restore_folds_update_back_like_dgc(exported):
    config, path = exported
    pte = PteEncoder(path, config, SHAPES)
    eager = DGCCompressor(config)
    grads = gradients(0)
    got, want = pte.compress(grads), eager.compress(grads)
    pte.restore(got)
    eager.restore(want)
    for name in SHAPES:
        assert torch.equal(pte.v[name], eager.memory.v[name]), name
    # and the next step still agrees, also in an encoder that continues from the saved state
    saved = pte.state_dict()
    assert_same_update(pte.compress(gradients(1)), want1 := eager.compress(gradients(1)))
    resumed = PteEncoder(path, config, SHAPES)
    resumed.load_state_dict(saved)
    assert_same_update(resumed.compress(gradients(1), sequence=want1.sequence), want1)
    with pytest.raises(StateError, match=r"encoder state 'v' must map names among"):
        resumed.load_state_dict({"step": 1, "u": {}, "v": {"nope": np.zeros(3)}})


def test_export_refuses_sampled_selection_and_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="selection='exact' only, got selection='sampled'"):
        export_encoder(DGCConfig(selection="sampled"))
    with pytest.raises(ConfigError, match="not ternary"):
        export_encoder(DGCConfig(selection="exact", ternary=True))
    # A phone's encoder refuses a run that asks for ternary values (a baked field).
    with pytest.raises(ConfigError, match="ternary: exported False, requested True"):
        check_compatible(DGCConfig(selection="exact"), DGCConfig(selection="exact", ternary=True))
    with pytest.raises(ConfigError, match="'shakespeare' takes torch.int64 inputs"):
        export_all("shakespeare", tmp_path)
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'"):
        export_all("resnet9000", tmp_path)
    with pytest.raises(ConfigError, match="max_numel must be an integer >= 2, got 0"):
        export_encoder(DGCConfig(selection="exact"), max_numel=0)
    with pytest.raises(ConfigError, match=r"parameters \['fc1.weight'\] have more than"):
        export_all("mlp-digits", tmp_path, max_numel=1000)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``python -m android_bridge export`` of mlp-digits, run once as a user runs it: the
    finished command and its folder (an export takes a minute on a busy machine; the manifest's
    and the command's output's tests share it)."""
    out = tmp_path_factory.mktemp("cli-export") / "exp"
    done = subprocess.run([sys.executable, "-m", "android_bridge", "export", "--model",
                           "mlp-digits", "--out", str(out), "--batch-size", "16",
                           "--learning-rate", "0.1", "--max-numel", str(MAX_NUMEL)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)
    return done, out


def test_export_all_manifest_and_training_parity(cli_export):
    """The CLI's export writes all files; train_step.pte trains like eager torch SGD."""
    done, out = cli_export
    assert done.returncode == 0, done.stderr
    manifest = load_manifest(out)
    names = [p["name"] for p in manifest["parameters"]]
    assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    # The run defaults' layer policy: tensors of 512 entries or more are sparsified, 1-D ones
    # too; fc2.weight (320) and the biases are shorter and sent dense.
    assert [p["dense"] for p in manifest["parameters"]] == [False, True, True, True]
    assert manifest["dgc_config"]["selection"] == "exact"
    assert manifest["versions"]["executorch"] == "1.5.1"
    import hashlib
    for part in ("encoder", "torchscript", "training"):
        data = (out / manifest[part]["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == manifest[part]["sha256"]
    # Real data: scikit-learn's 8x8 digits, scaled to [0, 1].
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    spec = get_model("mlp-digits")
    torch.manual_seed(42)
    global_model = spec.build()
    eager = copy.deepcopy(global_model)
    trainer = PteTrainer(out)
    assert trainer.learning_rate == 0.1
    trainer.set_parameters({k: p.detach().numpy() for k, p in global_model.named_parameters()})
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    step_fn = TrainingStep(eager)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 40 * 16, 16)]
    losses = trainer.train(batches)
    eager_losses = []
    for xb, yb in batches:
        opt.zero_grad()
        loss, _ = step_fn(torch.from_numpy(xb), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        eager_losses.append(float(loss))
    # Documented tolerance: 1e-5 absolute on parameters after 40 SGD steps (kernels differ in
    # summation order; measured ~1e-7).
    for name, p in eager.named_parameters():
        np.testing.assert_allclose(trainer.parameters()[name], p.detach().numpy(),
                                   rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(losses, eager_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]  # it learned something
    # Manifest-driven encoder on the trained model's pseudo-gradient agrees with dgc too.
    config = DGCConfig.from_dict(manifest["dgc_config"])
    pte = PteEncoder.from_export(out)
    delta = {k: global_model.state_dict()[k] - torch.from_numpy(v)
             for k, v in trainer.parameters().items()}
    assert_same_update(pte.compress(delta), DGCCompressor(config).compress(delta))
    with pytest.raises(StateError, match="parameter 'fc1.weight' has shape"):
        trainer.set_parameters({**trainer.parameters(), "fc1.weight": np.zeros((2, 2))})
    # Any batch of 1..16 examples (a client's last batch of an epoch is smaller), not more.
    assert manifest["training"]["dynamic_batch"] is True
    assert len(trainer.train([(x[:3], y[:3])])) == 1
    with pytest.raises(StateError, match=r"batch must be x\(n, 64\) and y\(n,\) with n in "
                                         r"1\.\.16, got x\(17, 64\)"):
        trainer.train([(x[:17], y[:17])])
    json.dumps(manifest)  # plain JSON values throughout


def test_cli_reports_bad_config(tmp_path, capsys):
    from android_bridge.__main__ import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"selection": "sampled"}))
    assert main(["export", "--out", str(tmp_path / "o"), "--config", str(cfg)]) == 2
    assert "selection='exact' only" in capsys.readouterr().err
    cfg.write_text(json.dumps({"densty": 0.1}))
    assert main(["export", "--out", str(tmp_path / "o"), "--config", str(cfg)]) == 2
    assert "unknown DGCConfig field(s) ['densty']" in capsys.readouterr().err


def test_pte_encoder_is_a_compressor_that_ages_and_gives_signs_like_dgc(exported):
    config, path = exported
    pte = PteEncoder(path, config, SHAPES)
    eager = DGCCompressor(config)
    assert isinstance(pte, Compressor) and isinstance(eager, Compressor)
    pte.compress(gradients(0))
    eager.compress(gradients(0))
    for c in (pte, eager):
        c.scale_state(0.5)  # a client away for a while (simulations.netem.staleness)
        c.residual()["w1"][:5] = 0.0  # in place, as the sign channel's take_signs changes it
    for name in SHAPES:
        assert torch.equal(pte.residual()[name], eager.residual()[name]), name
    assert_same_update(pte.compress(gradients(1)), eager.compress(gradients(1)))


def test_default_export_takes_a_default_runs_tasks():
    """With no options the export is made for a default run: the config, batch and lr the
    bridge app sends for a default run pass the phone's checks; the paper's settings (the old
    export default) are refused with the re-export message."""
    from android_bridge.bridge_app import _phone_config
    from android_bridge.export import federation_defaults
    from fedgc.settings import RunConfig

    defaults = federation_defaults()
    run = RunConfig.from_flat({"run_name": "t"})
    s, own = run.train, run.method.own
    sent = _phone_config(s, run.method)
    requested = DGCConfig.from_dict(sent["dgc"])
    check_compatible(defaults["config"], requested)
    assert defaults["config"] == requested
    assert (sent["train"]["batch_size"], sent["train"]["lr"]) == (defaults["batch_size"],
                                                                   defaults["learning_rate"])
    assert defaults["task"] == s.task
    paper = DGCConfig(selection="exact", momentum=0.9, momentum_correction=True)
    with pytest.raises(ConfigError, match="momentum_correction: exported True, requested "
                                          "False.*re-export with the requested config"):
        check_compatible(paper, requested)
    # The manifest's run_config: the server's own key names and default values.
    keys = defaults["run_config"]
    assert keys == {"method": s.method, "batch_size": s.batch_size, "lr": s.lr,
                    "dgc.momentum": own.momentum,
                    "dgc.momentum_correction": own.momentum_correction,
                    "dgc.nesterov": own.nesterov, "dgc.dampening": own.dampening,
                    "dgc.momentum_masking": own.momentum_masking,
                    "dgc.value_dtype": own.value_dtype, "dgc.ternary": own.ternary}
    assert (keys["dgc.momentum_correction"], keys["batch_size"], keys["lr"]) == (False, 10, 0.1)


def test_the_export_command_prints_only_its_own_lines(cli_export):
    """The toolchain's notices (20 FutureWarnings of torch.export's pytree, torchao's CUDA
    kernels, torch's enum deprecation) are not shown unless ``--verbose``."""
    done, _ = cli_export
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wrote encoder.pte"), lines



@pytest.mark.parametrize("name,build,shape", [
    ("conv1d-pool1d", lambda: torch.nn.Sequential(
        torch.nn.Conv1d(2, 4, 5, padding=2), torch.nn.ReLU(),
        torch.nn.MaxPool1d(2), torch.nn.Conv1d(4, 4, 3, stride=2, dilation=2),
        torch.nn.Flatten(), torch.nn.Linear(8, 3)), (2, 17)),
    ("conv2d-pool2d", lambda: torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d((2, 3)),
        torch.nn.Flatten(), torch.nn.Linear(36, 3)), (1, 7, 9)),
])
def test_training_step_rewrites_layers_executorch_differentiates_wrongly(name, build, shape,
                                                                         tmp_path):
    """Conv1d (ExecuTorch: "Only 2D Convolution Backward supported") and max pooling (its
    backward kernel returns gradients tens of times too large) train on the phone as in eager
    torch: their rewrites keep the parameters' names and shapes and give eager's gradients
    (checked at export; here again over SGD steps with momentum, batches of 5 and 2)."""
    from android_bridge.export import TRAIN_FILE, export_training_step
    from android_bridge.models import ModelSpec

    spec = ModelSpec(name, build, shape, 3)
    torch.manual_seed(0)
    model = build()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    program = export_training_step(spec, model, 5)
    (tmp_path / TRAIN_FILE).write_bytes(program)
    (tmp_path / "manifest.json").write_text(json.dumps({"training": {
        "input_shape": [5, *shape], "learning_rate": 0.1, "dynamic_batch": True}}))
    trainer = PteTrainer(tmp_path)
    assert set(trainer.parameters()) == set(start)
    trainer.set_parameters({k: v.numpy() for k, v in start.items()})
    trainer.set_learning_rate(0.1, momentum=0.5)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn((n, *shape), generator=g), torch.randint(3, (n,), generator=g))
               for n in (5, 5, 2)]
    trainer.train((x.numpy(), y.numpy()) for x, y in batches)
    local = trainer.parameters()
    eager = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for x, y in batches:
        eager.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        eager.step()
    for k, v in model.state_dict().items():
        assert np.abs(local[k] - v.numpy()).max() < 1e-5, k


def test_export_refuses_a_model_executorch_differentiates_wrongly():
    """Max pooling over overlapping windows is not rewritten: ExecuTorch's gradients differ
    from torch's, and the export says so (naming the parameters) instead of writing a training
    step that would train differently on the phone."""
    from android_bridge.export import export_training_step
    from android_bridge.models import ModelSpec

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.MaxPool2d(3, stride=2), torch.nn.Flatten(),
                                   torch.nn.Linear(36, 3))

    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"model 'overlap': ExecuTorch's kernels compute "
                                          r"other gradients than torch for \['0.weight', "
                                          r"'0.bias'\]"):
        export_training_step(ModelSpec("overlap", build, (1, 8, 8), 3), build(), 4)


def test_export_refuses_a_training_step_that_does_not_run_naming_the_kernel(capfd):
    """A circular-padded Conv1d exports but fails at a batch of 1 in the runtime (its padded
    tensor cannot be resized): refused at export, the runtime's failed check in the message,
    and nothing of the runtime's log left on stderr."""
    from android_bridge.export import export_training_step
    from android_bridge.models import ModelSpec

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3, padding=1, padding_mode="circular"),
                                   torch.nn.Flatten(), torch.nn.Linear(16, 3))

    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"model 'circular': its exported training step does "
                                          r"not run in the ExecuTorch runtime \(a batch of 1: "
                                          r".*KernelCall failed at instruction .* in operator "):
        export_training_step(ModelSpec("circular", build, (1, 8), 3), build(), 4)
    assert "KernelCall" not in capfd.readouterr().err
