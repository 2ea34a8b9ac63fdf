"""Stale-residual policies: keep, decay and drop after T rounds, on a real DGC compressor."""

from __future__ import annotations

import pytest
import torch

from dgc import DGCCompressor, DGCConfig, encode
from simulations.netem import LinkConfigError
from simulations.netem.staleness import StalePolicy, apply_stale_policy


def _compressor() -> DGCCompressor:
    c = DGCCompressor(DGCConfig(density=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        c.compress({"w": torch.randn(40, 50, generator=g)})
    return c


def test_keep_never_touches_the_residual() -> None:
    c = _compressor()
    v = {k: t.clone() for k, t in c.memory.v.items()}
    rep = apply_stale_policy(c, 500, StalePolicy("keep"))
    assert rep.factor == 1.0 and rep.discarded_l1 == 0.0
    assert all(torch.equal(v[k], c.memory.v[k]) for k in v)


def test_decay_scales_residual_and_momentum_by_rounds_beyond_t() -> None:
    policy = StalePolicy("decay", decay=0.5, after_rounds=2)
    c = _compressor()
    v, u = c.memory.v["w"].clone(), c.memory.u["w"].clone()
    assert apply_stale_policy(c, 2, policy).factor == 1.0  # within the grace period
    assert torch.equal(c.memory.v["w"], v)
    rep = apply_stale_policy(c, 5, policy)
    assert rep.factor == 0.125
    assert torch.allclose(c.memory.v["w"], v * 0.125) and torch.allclose(c.memory.u["w"], u * 0.125)
    assert rep.residual_l1_after == pytest.approx(rep.residual_l1_before * 0.125, rel=1e-6)
    assert rep.residual_l1_before == pytest.approx(float(v.abs().sum()), rel=1e-6)


def test_drop_after_t_rounds_zeroes_and_reports_the_mass() -> None:
    policy = StalePolicy("drop", after_rounds=3)
    c = _compressor()
    assert apply_stale_policy(c, 3, policy).discarded_l1 == 0.0
    mass = float(c.memory.v["w"].abs().sum())
    rep = apply_stale_policy(c, 4, policy)
    assert rep.factor == 0.0 and rep.discarded_l1 == pytest.approx(mass, rel=1e-6)
    assert not c.memory.v["w"].any() and not c.memory.u["w"].any()
    # The compressor goes on from a clean slate: what it sends next is the new gradient alone.
    out = c.compress({"w": torch.full((40, 50), 2.0)})
    assert out.nnz > 0 and bool((out.tensors["w"].values.float() == 2.0).all())


@pytest.mark.parametrize("kwargs,field", [
    ({"mode": "forget"}, "mode"),
    ({"mode": "decay", "decay": 0.0}, "decay"),
    ({"mode": "decay", "decay": 1.5}, "decay"),
    ({"after_rounds": -1}, "after_rounds"),
])
def test_bad_policies_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LinkConfigError, match=field):
        StalePolicy(**kwargs)
    with pytest.raises(LinkConfigError, match="rounds_away"):
        StalePolicy().factor(-1)


def _age(record: dict, round_index: int, ack: int, policy: StalePolicy,
         make: object = None, model_version: int | None = None) -> object:
    """The emulator's stale policy on a dgc client's record (its compressor rebuilt by ``make``,
    by default a plain DGCCompressor of the test's config)."""
    from fedgc.methods import get
    from fedgc.settings import RunConfig
    from simulations.netem.staleness import apply_stale_policy_to_record

    make = make or (lambda: DGCCompressor(DGCConfig(density=0.1, warmup="none")))
    return apply_stale_policy_to_record(record, round_index, ack, policy, make, get("dgc"),
                                        # The update folded back whole (the method's own
                                        # decay, tests/test_unaggregated.py, set aside).
                                        RunConfig.from_flat({"run_name": "t",
                                                             "unaggregated": "keep"}).train,
                                        model_version)


def _record(c: DGCCompressor, last: object) -> dict:
    """What client.app stores: the compressor state and the encoded last update."""
    import dgc

    data = dgc.encode(last)
    return {"compressor": c.state_dict(),
            "pending": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


def test_stale_policy_on_a_stored_record_folds_back_unacked_pending_first() -> None:

    c = DGCCompressor(DGCConfig(density=0.1, warmup="none"))
    g = torch.Generator().manual_seed(1)
    last = c.compress({"w": torch.randn(40, 50, generator=g)}, sequence=3)
    v = c.memory.v["w"].clone()
    pending_dense = last.tensors["w"].to_dense().reshape(-1).float()

    keep = _record(c, last)
    assert _age(keep, 10, -1, StalePolicy("keep")) is None
    assert "pending" in keep
    # Back in round 4 (0 rounds away): within any grace, nothing to do.
    assert _age(_record(c, last), 4, -1, StalePolicy("drop")) is None

    decayed = _record(c, last)  # round 8: 4 rounds away, unacknowledged
    rep = _age(decayed, 8, -1, StalePolicy("decay", 0.5, 2))
    assert rep.factor == 0.25 and "pending" not in decayed
    after = decayed["compressor"]["memory"]["v"]["w"]
    assert torch.allclose(after, (v + pending_dense) * 0.25, atol=1e-6)

    acked = _record(c, last)  # the same, but the server aggregated it: not folded back
    _age(acked, 8, 3, StalePolicy("decay", 0.5, 2))
    assert torch.allclose(acked["compressor"]["memory"]["v"]["w"], v * 0.25, atol=1e-6)

    dropped = _record(c, last)
    rep = _age(dropped, 6, -1, StalePolicy("drop", after_rounds=1))
    assert rep.factor == 0.0 and not dropped["compressor"]["memory"]["v"]["w"].any()
    assert rep.discarded_l1 == pytest.approx(float((v + pending_dense).abs().sum()), rel=1e-5)


def test_under_async_the_stale_policy_counts_model_versions() -> None:
    """Issue 37: an asynchronous dispatch's sequence counts dispatches (about K per applied
    step). The client's last update (sequence 3) trained on model version 5; dispatched at
    sequence 40 on version 6 it is 0 steps away (nothing to age), on version 9 three; a sync
    round 40 (no version given) is 36 rounds away."""
    c = DGCCompressor(DGCConfig(density=0.1, warmup="none"))
    last = c.compress({"w": torch.randn(40, 50, generator=torch.Generator().manual_seed(2))},
                      sequence=3)
    v = c.memory.v["w"].clone()

    def record() -> dict:
        return {**_record(c, last), "reply": {"sequence": 3, "model_version": 5}}

    policy = StalePolicy("decay", 0.5, 0)
    assert _age(record(), 40, 3, policy, model_version=6) is None
    three = record()
    assert _age(three, 40, 3, policy, model_version=9).factor == 0.5 ** 3
    assert torch.allclose(three["compressor"]["memory"]["v"]["w"], v * 0.125, atol=1e-6)
    assert _age(record(), 40, 3, policy).factor == 0.5 ** 36


def test_stale_policy_ages_both_parts_of_a_two_density_record() -> None:
    # fedgc's default client compressor is a TwoDensityCompressor, whose state carries no config:
    # the policy must rebuild it through the client's own factory and age both parts.
    from dgc.two_density import TwoDensityCompressor

    def make() -> TwoDensityCompressor:
        return TwoDensityCompressor(DGCConfig(density=0.01, warmup="none"), 0.2, small_numel=500)

    c = make()
    g = torch.Generator().manual_seed(2)
    last = c.compress({"big": torch.randn(40, 50, generator=g),
                       "head": torch.randn(10, 20, generator=g)}, sequence=3)
    before = {k: t.clone() for k, t in c.residual().items()}
    acked = {"compressor": c.state_dict(),
             "pending": torch.frombuffer(bytearray(encode(last)), dtype=torch.uint8)}
    rep = _age(acked, 8, 3, StalePolicy("decay", 0.5, 2), make)
    assert rep.factor == 0.25
    aged = make()
    aged.load_state_dict(acked["compressor"])
    for name, t in aged.residual().items():
        assert torch.allclose(t, before[name] * 0.25, atol=1e-7), name


def test_stale_policy_folds_back_unacked_shared_signs_too() -> None:
    """A record with the shared sign channel's pending signs: folded back with the update."""
    import numpy as np

    from dgc.signs import encode_mask, encode_signs, take_signs

    c = DGCCompressor(DGCConfig(density=0.1, warmup="none"))
    g = torch.Generator().manual_seed(4)
    last = c.compress({"w": torch.randn(40, 50, generator=g)}, sequence=3)
    mask = {"w": np.arange(0, 2000, 40, dtype=np.int64)}
    signs = take_signs(c.residual(), mask, 3)
    v = c.memory.v["w"].clone()
    record = {**_record(c, last),
              "pending_shared": torch.frombuffer(bytearray(encode_signs(signs)),
                                                 dtype=torch.uint8),
              "pending_mask": torch.frombuffer(bytearray(encode_mask(mask, {"w": 2000}, 3)),
                                               dtype=torch.uint8)}
    _age(record, 8, -1, StalePolicy("decay", 0.5, 2))
    expected = (v + last.tensors["w"].to_dense().reshape(-1).float()
                + signs.tensors["w"].to_dense().reshape(-1)) * 0.25
    assert torch.allclose(record["compressor"]["memory"]["v"]["w"], expected, atol=1e-6)
    assert not {"pending", "pending_shared", "pending_mask"} & set(record)
