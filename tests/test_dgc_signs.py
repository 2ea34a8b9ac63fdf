"""dgc.signs: the server's choice of shared indices, the clients' scaled signs, both codings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgc import ConfigError, DecodeError, StateError
from dgc.signs import (
    SharedIndexPlanner,
    decode_mask,
    decode_signs,
    encode_mask,
    encode_signs,
    take_signs,
)

SHAPES = {"w": (20, 50), "head": (10, 20)}
NUMELS = {"w": 1000, "head": 200}


def _planner(**kw) -> SharedIndexPlanner:
    return SharedIndexPlanner(SHAPES, **{"density": 0.05, **kw})


def test_planner_ranks_by_moving_average_of_aggregates():
    p = _planner(momentum=0.5)
    assert p.plan() == {}  # nothing seen yet: no shared set in the first round
    first = torch.zeros(1000)
    first[[3, 7, 11]] = torch.tensor([5.0, -4.0, 3.0])
    second = torch.zeros(1000)
    second[[7, 500]] = torch.tensor([-4.0, 6.0])
    p.observe({"w": first.view(20, 50)})
    p.observe({"w": second.view(20, 50)})
    # average = 0.5 * first + second: |7| = 6, |500| = 6, |3| = 2.5, |11| = 1.5
    mask = p.plan()["w"]
    assert mask.dtype == np.int64 and len(mask) == 50
    assert {3, 7, 11, 500} <= set(mask.tolist()) and mask.tolist() == sorted(set(mask.tolist()))
    # The other 46 tie at zero; whichever are taken, planning again takes the same ones.
    assert p.plan()["w"].tolist() == mask.tolist()
    top2 = np.argsort(-p.average["w"].abs().numpy(), kind="stable")[:2]
    assert set(top2.tolist()) == {7, 500}


def test_planner_counts_small_tensors_with_their_own_density():
    p = _planner(small_density=0.5, small_numel=200)
    assert p.count("w") == 50 and p.count("head") == 100
    assert _planner().count("head") == 10  # small_density 0: the common density


@pytest.mark.parametrize("kw", [dict(density=0.0), dict(density=1.5), dict(density=float("nan")),
                                dict(small_density=-0.1), dict(momentum=1.0),
                                dict(momentum=True)])
def test_planner_rejects_bad_settings(kw):
    with pytest.raises(ConfigError):
        _planner(**kw)


def test_planner_state_round_trips_and_rejects_foreign_state():
    p = _planner()
    p.observe({"w": torch.randn(20, 50), "head": torch.randn(10, 20)})
    q = _planner()
    q.load_state_dict(p.state_dict())
    assert {k: v.tolist() for k, v in q.plan().items()} == \
        {k: v.tolist() for k, v in p.plan().items()}
    before = q.state_dict()
    with pytest.raises(StateError, match="unknown tensor 'x'"):
        q.load_state_dict({"average": {"x": torch.zeros(3)}})
    with pytest.raises(StateError, match="1000 entries"):
        q.load_state_dict({"average": {"w": torch.zeros(3)}})
    assert torch.equal(q.state_dict()["average"]["w"], before["average"]["w"])


def test_take_signs_sends_scaled_signs_and_keeps_the_rest():
    torch.manual_seed(0)
    v = torch.randn(1000)
    before = v.clone()
    mask = np.array([1, 5, 9, 400, 999], dtype=np.int64)
    sent = take_signs({"w": v}, {"w": mask}, sequence=7)
    t = sent.tensors["w"]
    scale = float(before[mask].abs().mean())
    assert sent.sequence == 7 and t.indices.tolist() == mask.tolist()
    assert torch.allclose(t.values.abs(), torch.full((5,), scale))
    assert torch.equal(torch.sign(t.values), torch.sign(before[mask]))
    # Mass is conserved: what was sent plus what is left is what there was.
    torch.testing.assert_close(v[mask] + t.values, before[mask], rtol=0, atol=1e-6)
    untouched = np.setdiff1d(np.arange(1000), mask)
    assert torch.equal(v[untouched], before[untouched])


def test_take_signs_refuses_indices_it_cannot_honour():
    v = torch.zeros(10)
    with pytest.raises(StateError, match=r"outside \[0, 10\)"):
        take_signs({"w": v}, {"w": np.array([3, 10])}, 1)
    with pytest.raises(StateError, match="does not hold"):
        take_signs({"w": v}, {"x": np.array([0])}, 1)
    assert torch.equal(v, torch.zeros(10))


def _round_trip_inputs():
    torch.manual_seed(1)
    masks = {"w": np.sort(np.random.default_rng(0).choice(1000, 37, replace=False)),
             "head": np.array([0, 199])}
    sent = take_signs({"w": torch.randn(1000), "head": torch.randn(200)}, masks, 3)
    return masks, sent


def test_mask_and_signs_round_trip_bit_for_bit():
    masks, sent = _round_trip_inputs()
    seq, got = decode_mask(encode_mask(masks, NUMELS, 3), NUMELS)
    assert seq == 3 and {k: v.tolist() for k, v in got.items()} == \
        {k: v.tolist() for k, v in masks.items()}
    data = encode_signs(sent)
    # 1 bit per entry: 37 signs fit 5 bytes
    assert len(data) < 2 * (17 + 2 + 12) + 5 + 1 + 4
    back = decode_signs(data, masks, {"w": (20, 50), "head": (10, 20)})
    assert back.sequence == 3
    for name, t in back.tensors.items():
        assert t.shape == SHAPES[name]
        assert torch.equal(t.indices, sent.tensors[name].indices)
        assert torch.equal(t.values, sent.tensors[name].values)


def test_decode_signs_rejects_each_defect_with_its_reason():
    masks, sent = _round_trip_inputs()
    data = encode_signs(sent)
    shapes = {"w": (1000,), "head": (200,)}
    with pytest.raises(DecodeError, match="bad checksum: stored CRC32"):
        decode_signs(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], masks, shapes)
    with pytest.raises(DecodeError, match="truncated input"):
        decode_signs(data[:10], masks, shapes)
    with pytest.raises(DecodeError, match="magic"):
        decode_signs(encode_mask(masks, NUMELS, 3), masks, shapes)
    with pytest.raises(DecodeError, match="signs for 'w', its index set holds 36"):
        decode_signs(data, {**masks, "w": masks["w"][:-1]}, shapes)
    with pytest.raises(DecodeError, match="no shared index set"):
        decode_signs(data, {"w": masks["w"]}, shapes)
    with pytest.raises(DecodeError, match=r"no signs for \['extra'\]"):
        decode_signs(data, {**masks, "extra": np.array([1])}, {**shapes, "extra": (5,)})
    with pytest.raises(DecodeError, match="decode takes bytes"):
        decode_signs("text", masks, shapes)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_decode_signs_rejects_a_bad_scale(scale):
    import struct
    import zlib

    body = (struct.pack("<4sBQI", b"FGCS", 1, 1, 1) + struct.pack("<H", 1) + b"w"
            + struct.pack("<Qf", 2, scale) + b"\x01")
    with pytest.raises(DecodeError, match="scale of 'w'"):
        decode_signs(body + struct.pack("<I", zlib.crc32(body)), {"w": np.array([0, 1])},
                     {"w": (4,)})


def test_decode_signs_rejects_nonzero_padding():
    import struct
    import zlib

    body = (struct.pack("<4sBQI", b"FGCS", 1, 1, 1) + struct.pack("<H", 1) + b"w"
            + struct.pack("<Qf", 2, 0.5) + b"\x05")  # bit 2 set, only 2 signs
    with pytest.raises(DecodeError, match="padding bits"):
        decode_signs(body + struct.pack("<I", zlib.crc32(body)), {"w": np.array([0, 1])},
                     {"w": (4,)})


def test_decode_mask_rejects_a_mask_for_another_model():
    masks, _ = _round_trip_inputs()
    data = encode_mask(masks, NUMELS, 3)
    with pytest.raises(DecodeError, match="is for 1000 entries, expected 999"):
        decode_mask(data, {"w": 999, "head": 200})


def test_encode_signs_refuses_values_that_are_not_one_scale():
    _, sent = _round_trip_inputs()
    sent.tensors["w"].values[0] *= 2
    with pytest.raises(StateError, match="not \\+-one finite scale"):
        encode_signs(sent)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_corrupted_messages_only_ever_raise_decode_error(data):
    masks, sent = _round_trip_inputs()
    shapes = {"w": (1000,), "head": (200,)}
    for blob, decode in ((encode_signs(sent), lambda b: decode_signs(b, masks, shapes)),
                         (encode_mask(masks, NUMELS, 3), lambda b: decode_mask(b, NUMELS))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        cut = data.draw(st.booleans())
        bad = blob[:pos] if cut else blob[:pos] + bytes([blob[pos] ^ 0xFF]) + blob[pos + 1:]
        with pytest.raises(DecodeError):
            decode(bad)
