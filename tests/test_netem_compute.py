"""The emulator's compute scaled to the model's cost (netem.compute_scale,
simulations/netem/compute.py): counted multiply-adds, the factor, its key and its charge."""

from __future__ import annotations

import math

import pytest
import torch

from fedgc.settings import RunConfig, SettingsError
from simulations.netem.compute import REFERENCE_MACS, forward_macs, scale_for
from simulations.netem.integration import for_run
from simulations.netem.mod import reply_metrics
from simulations.netem.settings import NetemSettings, assignment_for
from tasks import build_model

# task_identity: test_netem_mod's autouse fixture (a run identity for the messages), used here too.
from tests.test_netem_mod import _app, _context, _message, task_identity  # noqa: F401

#: LEAF's FEMNIST CNN (fashion-mnist-6m's model) on 28x28x1, by hand: conv 1->32 and 32->64
#: (5x5, same), fc 3136->2048, fc 2048->10.
LEAF_MACS = 32 * 25 * 784 + 64 * 32 * 25 * 196 + 3136 * 2048 + 2048 * 10


def test_multiply_adds_are_counted_layer_by_layer() -> None:
    image = torch.zeros(1, 1, 28, 28)
    assert forward_macs(build_model("mlp", (1, 28, 28), 10), image) == 784 * 200 + 200 * 10
    # The reference is the default small CNN on a 28x28 image, exactly.
    assert forward_macs(build_model("cnn", (1, 28, 28), 10), image) == REFERENCE_MACS
    leaf = build_model("cnn", (1, 28, 28), 10, channels=(32, 64), hidden=2048)
    assert forward_macs(leaf, image) == LEAF_MACS == 17_105_408
    # Per sample: a batch of four counts the same.
    assert forward_macs(leaf, torch.zeros(4, 1, 28, 28)) == LEAF_MACS


def test_the_factor_is_the_ratio_at_least_one() -> None:
    assert scale_for(158_800) == 1.0 == scale_for(REFERENCE_MACS)
    assert scale_for(LEAF_MACS) == pytest.approx(5.6558, abs=1e-4)
    with pytest.raises(SettingsError, match="reference > 0"):
        scale_for(100, reference=0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "fast"])
def test_a_bad_compute_scale_is_refused_by_name(bad: object) -> None:
    with pytest.raises(SettingsError, match="netem.compute_scale"):
        NetemSettings(compute_scale=bad)  # type: ignore[arg-type]


def _config(tmp_path, **keys: object) -> RunConfig:
    return RunConfig.from_flat({"task": "digits", "num_clients": 4, "clients_per_round": 2,
                                "rounds": 1, "results_dir": str(tmp_path), **keys})


def test_a_run_derives_the_factor_from_its_model_unless_the_key_sets_it(tmp_path) -> None:
    on = NetemSettings(enabled=True)
    assert on.compute_scale == 0 and on.compute_factor == 1.0  # not derived yet: the presets'
    assert for_run(on, _config(tmp_path)).compute_scale == 1.0  # digits' MLP: under the reference
    leaf = _config(tmp_path, task="fashion-mnist", model="cnn",
                   model_options='{"channels": [32, 64], "hidden": 2048}')
    assert for_run(on, leaf).compute_scale == pytest.approx(LEAF_MACS / REFERENCE_MACS)
    assert for_run(NetemSettings(enabled=True, compute_scale=2.5), leaf).compute_scale == 2.5
    # Recorded with the run's netem keys (summary.json's "netem", the resumed run's check).
    assert for_run(on, leaf).to_config()["netem.compute_scale"] == pytest.approx(5.6558, abs=1e-4)


def test_the_mod_charges_the_presets_compute_times_the_factor() -> None:
    plain = NetemSettings(enabled=True, mix="3g:1.0", num_clients=8, seed=3, local_epochs=2.0,
                          protocol="none")
    scaled = NetemSettings(enabled=True, mix="3g:1.0", num_clients=8, seed=3, local_epochs=2.0,
                           protocol="none", compute_scale=4.0)
    presets_s = assignment_for(plain)[5].device.compute_seconds(120, 2.0)
    for settings, factor in ((plain, 1.0), (scaled, 4.0)):
        m = reply_metrics(_app([])(_message(settings), _context(5)))
        assert m["compute_s"] == pytest.approx(presets_s * factor)
