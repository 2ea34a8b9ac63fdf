"""Tests of DGCConfig: defaults, warm-up schedules, validation of every field, dict round trip."""

from __future__ import annotations

import dataclasses

import pytest

from dgc.config import DGCConfig
from dgc.errors import ConfigError


def test_paper_defaults() -> None:
    c = DGCConfig()
    assert (c.density, c.momentum, c.sample_ratio, c.warmup, c.warmup_epochs) == (
        0.001, 0.9, 0.01, "exponential", 4)
    assert c.momentum_correction and c.momentum_masking and c.error_feedback
    assert c.clip_norm is None and c.selection == "sampled"


def test_exponential_warmup_is_the_papers() -> None:
    c = DGCConfig()
    assert [c.density_at(e) for e in range(7)] == [
        0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001, 0.001]
    # Fractional epochs use the schedule of the epoch they fall in.
    assert c.density_at(1.99) == 0.0625 and c.density_at(4.5) == 0.001


def test_exponential_warmup_never_goes_below_the_target_and_respects_its_length() -> None:
    c = DGCConfig(density=0.1)
    assert [c.density_at(e) for e in range(3)] == [0.25, 0.1, 0.1]
    c = DGCConfig(warmup_epochs=1)  # PTB and speech: one warm-up epoch
    assert [c.density_at(e) for e in range(3)] == [0.25, 0.001, 0.001]
    assert DGCConfig(warmup_epochs=0).density_at(0) == 0.001


def test_dense_epochs_come_first() -> None:
    c = DGCConfig(dense_epochs=2)
    assert [c.density_at(e) for e in range(7)] == [
        1.0, 1.0, 0.25, 0.0625, 0.015625, 0.00390625, 0.001]


def test_list_and_no_warmup() -> None:
    c = DGCConfig(warmup="list", warmup_densities=[0.5, 0.1, 0.0001], dense_epochs=1)
    # Listed densities under the target are raised to it (documented).
    assert [c.density_at(e) for e in range(6)] == [1.0, 0.5, 0.1, 0.001, 0.001, 0.001]
    assert c.warmup_densities == (0.5, 0.1, 0.0001)
    assert [DGCConfig(warmup="none", density=0.01).density_at(e) for e in range(3)] == [0.01] * 3


@pytest.mark.parametrize("epoch", [-1, -0.5, float("nan"), float("inf"), "1", None])
def test_density_at_rejects_bad_epochs(epoch: object) -> None:
    with pytest.raises(ConfigError, match="epoch"):
        DGCConfig().density_at(epoch)  # type: ignore[arg-type]


BAD_VALUES = [
    ("density", 0.0), ("density", 1.5), ("density", -0.1), ("density", float("nan")),
    ("density", "0.1"), ("density", True), ("density", None),
    ("selection", "topk"), ("selection", None),
    ("sample_ratio", 0.0), ("sample_ratio", 2.0),
    ("min_count_ratio", 0.0), ("min_count_ratio", 1.1),
    ("max_adaptations", -1), ("max_adaptations", 1.5), ("max_adaptations", True),
    ("momentum", 1.0), ("momentum", -0.1), ("momentum", float("nan")), ("momentum", True),
    ("momentum", "0.9"),
    ("dampening", 1.5), ("dampening", -0.1), ("dampening", True),
    ("clip_norm", 0.0), ("clip_norm", -1.0), ("clip_norm", float("inf")),
    ("clip_norm", float("nan")), ("clip_norm", True), ("clip_norm", "1"),
    ("num_workers", 0), ("num_workers", 2.0), ("num_workers", False),
    ("warmup", "linear"), ("warmup", None),
    ("warmup_epochs", -1), ("warmup_epochs", 1.0),
    ("dense_epochs", -1), ("dense_epochs", "2"),
    ("min_sparse_numel", 0), ("min_sparse_numel", 1.5),
    ("value_dtype", "float64"), ("value_dtype", "int8"),
    ("momentum_correction", 1), ("nesterov", "yes"), ("momentum_masking", None),
    ("error_feedback", 0), ("check_finite", "true"), ("ternary", 1), ("sparse_vectors", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_values_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        DGCConfig(**{field: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(warmup="list", warmup_densities=()), "warmup_densities"),
        (dict(warmup="list", warmup_densities=[0.5, 0.0]), r"warmup_densities\[1\]"),
        (dict(warmup="list", warmup_densities=[0.5, 1.5]), r"warmup_densities\[1\]"),
        (dict(warmup="list", warmup_densities=["a"]), r"warmup_densities\[0\]"),
        (dict(warmup="list", warmup_densities=5), "warmup_densities"),
        (dict(warmup="list", warmup_densities="0.5"), "warmup_densities"),
        (dict(warmup_densities=[0.5]), "warmup_densities"),  # given, but the schedule ignores it
    ],
)
def test_bad_warmup_lists(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DGCConfig(**kwargs)


def test_every_field_is_validated() -> None:
    # A new field without a rejected value in BAD_VALUES (or the warm-up list tests) fails here.
    covered = {f for f, _ in BAD_VALUES} | {"warmup_densities"}
    assert {f.name for f in dataclasses.fields(DGCConfig)} == covered


def test_dict_round_trip_and_unknown_keys() -> None:
    c = DGCConfig(density=0.01, nesterov=True, clip_norm=2.5, num_workers=8, warmup="list",
                  warmup_densities=[0.3, 0.05], value_dtype="bfloat16", selection="exact")
    d = c.to_dict()
    assert d["warmup_densities"] == [0.3, 0.05]
    assert DGCConfig.from_dict(d) == c
    with pytest.raises(ConfigError, match="denisty"):
        DGCConfig.from_dict({**d, "denisty": 0.1})
    with pytest.raises(ConfigError, match="momentum"):
        DGCConfig.from_dict({**d, "momentum": 2.0})


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DGCConfig().density = 0.5  # type: ignore[misc]
