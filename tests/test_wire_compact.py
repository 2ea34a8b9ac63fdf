"""dgc.wire.compact: the update message for a model both ends know (tensors by place, varint
sizes): the same tensors back bit for bit in fewer bytes, every defect a DecodeError."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

import dgc
from dgc.errors import DecodeError, EncodeError
from dgc.signs.client import on_grid
from dgc.signs.codec import decode_shared, encode_values
from dgc.wire.compact import decode_compact, encode_compact, layout_of
from fedgc.methods.payloads import Bound, SparseCodec

SHAPES = {"lstm.weight_hh_l0": (512, 128), "lstm.bias_ih_l0": (512,), "head.weight": (76, 128),
          "head.bias": (76,)}
LAYOUT = layout_of(SHAPES)


def _update(kind: str, seed: int = 0) -> dgc.SparseUpdate:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        k = n if name == "head.bias" else max(1, n // 200)
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values
        v = torch.randn(k, generator=g) * 0.01
        if kind == "grid":
            v = on_grid(v, 4.0)
        elif kind == "sign":
            v = (torch.sign(v) * 0.5).half()
        else:
            v = v.half()
        tensors[name] = dgc.SparseTensor(idx, v, shape)
    return dgc.SparseUpdate(tensors, 2**40 + 3)


def _same(a: dgc.SparseUpdate, b: dgc.SparseUpdate) -> bool:
    return a.sequence == b.sequence and a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[n].indices, b.tensors[n].indices)
        and torch.equal(a.tensors[n].values, b.tensors[n].values)
        and a.tensors[n].shape == b.tensors[n].shape for n in a.tensors)


@pytest.mark.parametrize("kind", ["half", "grid", "sign"])
def test_the_same_tensors_come_back_bit_for_bit_in_fewer_bytes(kind):
    u = _update(kind)
    switches = {"grid_coding": kind == "grid", "sign_coding": kind == "sign"}
    compact = encode_compact(u, LAYOUT, **switches)
    back = decode_compact(compact, LAYOUT, max_numel=65536)
    assert _same(back, dgc.decode(dgc.encode(u, **switches), max_numel=65536))
    assert len(compact) < len(dgc.encode(u, **switches)) - 4 * 30  # >30 bytes a tensor saved


def test_a_subset_of_the_model_and_the_codec_and_side_part_paths():
    part = dgc.SparseUpdate({"head.weight": _update("grid").tensors["head.weight"]}, 5)
    back = decode_compact(encode_compact(part, LAYOUT, grid_coding=True), LAYOUT,
                          max_numel=65536)
    assert _same(back, part)
    codec = SparseCodec(grid_coding=True, compact=True)
    u = _update("grid", 1)
    assert _same(codec.decode(codec.encode(u), Bound(SHAPES)).update, u)
    masks = {"head.weight": np.arange(0, 9728, 7), "lstm.bias_ih_l0": np.arange(0, 512, 3)}
    sent = dgc.SparseUpdate({n: dgc.SparseTensor(torch.from_numpy(m),
                                                 on_grid(torch.randn(len(m)) * 0.01, 0.5),
                                                 SHAPES[n]) for n, m in masks.items()}, 9)
    for compact in (False, True):
        got = decode_shared(encode_values(sent, compact=compact), masks, SHAPES)
        assert all(torch.equal(got.tensors[n].values, sent.tensors[n].values.float())
                   for n in masks)
    assert len(encode_values(sent, compact=True)) < len(encode_values(sent))


def test_a_message_about_another_model_or_tensor_is_refused():
    data = encode_compact(_update("grid"), LAYOUT, grid_coding=True)
    other = layout_of({**SHAPES, "head.bias": (77,)})
    with pytest.raises(DecodeError, match="layout digest"):
        decode_compact(data, other, max_numel=65536)
    with pytest.raises(DecodeError, match="above max_numel"):
        decode_compact(data, LAYOUT, max_numel=1000)
    with pytest.raises(EncodeError, match="not in the model's layout"):
        encode_compact(dgc.SparseUpdate({"x": dgc.SparseTensor(
            torch.tensor([0]), torch.tensor([1.0]), (3,))}, 0), LAYOUT)
    with pytest.raises(EncodeError, match="the layout's is"):
        encode_compact(dgc.SparseUpdate({"head.bias": dgc.SparseTensor(
            torch.tensor([0]), torch.tensor([1.0]), (75,))}, 0), LAYOUT)


def _resealed(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_every_defect_is_a_decode_error_that_names_it():
    data = encode_compact(_update("grid"), LAYOUT, grid_coding=True)
    body = data[:-4]
    for cut in range(len(data)):  # every truncation
        with pytest.raises(DecodeError):
            decode_compact(data[:cut], LAYOUT, max_numel=65536)
    flipped = bytearray(data)
    flipped[20] ^= 0x40
    with pytest.raises(DecodeError, match="bad checksum"):
        decode_compact(bytes(flipped), LAYOUT, max_numel=65536)
    head = len(b"FGCK") + 1 + 4
    seq = body[head:head + 6]  # the sequence's varint: 2**40 + 3, six bytes
    # a place beyond the layout: the first tensor's gap pushed past the four tensors
    count_at = head + len(seq)
    bad = bytearray(body)
    bad[count_at + 1] = 9
    with pytest.raises(DecodeError, match="beyond the model's 4 tensors"):
        decode_compact(_resealed(bytes(bad)), LAYOUT, max_numel=65536)
    # more tensors than the model holds
    bad = bytearray(body)
    bad[count_at] = 5
    with pytest.raises(DecodeError, match="5 tensors for a model of 4"):
        decode_compact(_resealed(bytes(bad)), LAYOUT, max_numel=65536)
    # a varint padded with a zero byte is not canonical
    padded = body[:head] + bytes([seq[0] | 0x80]) + seq[1:-1] + bytes([seq[-1] | 0x80, 0])
    with pytest.raises(DecodeError, match="not a canonical varint"):
        decode_compact(_resealed(padded + body[head + 6:]), LAYOUT, max_numel=65536)
    with pytest.raises(DecodeError, match="trailing or oversized"):
        decode_compact(_resealed(body + b"\0"), LAYOUT, max_numel=65536)


def test_random_bytes_never_escape_as_another_error():
    data = encode_compact(_update("grid"), LAYOUT, grid_coding=True)
    rng = np.random.default_rng(0)
    for _ in range(300):
        body = bytearray(data[:-4])
        for at in rng.integers(9, len(body), size=3):
            body[int(at)] = int(rng.integers(0, 256))
        try:
            decode_compact(_resealed(bytes(body)), LAYOUT, max_numel=65536)
        except DecodeError:
            pass


# ----------------------------------------------------------------- downlink_compact
def _downlink(compact: bool, versions: int = 10):
    from collections import OrderedDict

    from server.downlink import Downlink

    d = Downlink("auto", 1000, 0.05, "int8", True, 0.5, "float16", True, compact)
    g = torch.Generator().manual_seed(0)
    model = OrderedDict([("w", torch.randn(60, 300, generator=g) * 0.05),
                         ("b", torch.zeros(60)), ("v", torch.randn(10, 60, generator=g))])
    d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
    sent = [{k: v.clone() for k, v in d.sent_model.items()}]
    busy = torch.rand(60, 300, generator=g) < 0.1
    for _ in range(versions):
        model = OrderedDict([("w", model["w"] + torch.where(
            busy, torch.randn(60, 300, generator=g) * 0.02, torch.zeros(60, 300))),
            ("b", model["b"] + 0.001), ("v", model["v"] * 1.01)])
        d.advance(model, model)
        sent.append({k: v.clone() for k, v in d.sent_model.items()})
    return d, sent


def test_compact_patches_rebuild_the_sent_model_on_every_base_in_fewer_bytes():
    from fedgc import protocol as P

    d, sent = _downlink(True)
    plain, _ = _downlink(False)
    ranked = 0
    for base in range(d.version):
        patch, other = d.coded_patch((base,)), plain.coded_patch((base,))
        assert patch.context == other.context and patch.added == other.added
        got = P.apply_patch(sent[base], patch.data, patch.added,
                            {n: d.origin[n] for n in patch.context})
        assert all(torch.equal(got[k].view(torch.int32), sent[-1][k].view(torch.int32))
                   for k in got), base
        assert len(patch.data) < len(other.data)
        ranked += bool(patch.context)
    assert ranked  # segments of the ranking travel by place too
    # a client told of other ranked tensors than the patch's holds another layout: refused
    patch = next(d.coded_patch((b,)) for b in range(1, d.version) if d.coded_patch((b,)).context)
    with pytest.raises(DecodeError, match="layout digest"):
        P.apply_patch(sent[1], patch.data, patch.added, None)


def test_phones_take_compact_patches_and_send_update_messages():
    """Issue 39: a run with phones may send compact patches (the bridge and the phone read
    them, tests/test_downlink_context.py); its phones still send update messages, so a
    compact uplink (dgc.compact_wire) stays refused."""
    from android_bridge.export import check_phone_run
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "dgc_sets", "downlink_compact": True})
    assert check_phone_run(run.method, run.server) is not None
    run = RunConfig.from_flat({"method": "dgc", "dgc.compact_wire": True})
    with pytest.raises(dgc.ConfigError, match="compact_wire"):
        check_phone_run(run.method, run.server)
