"""method = qsgd: QSGD's stochastic quantization with Elias-coded levels, added through the Method
contract (fedgc/methods/qsgd.py, dgc/elias.py): unbiased levels, the wire's bytes and bounds,
the server's checks, the optional residual, and a federation that learns and resumes."""

from __future__ import annotations

import csv
import struct
import zlib

import numpy as np
import pytest
import torch

from dgc import DecodeError
from dgc.elias import GammaError, gamma_bits, gamma_length, read_gamma
from fedgc.methods import Bound, PayloadError, get
from fedgc.methods.qsgd import LevelsCodec, LevelsUpdate, dequantize, quantize
from fedgc.settings import RunConfig
from simulations.cli import main

SHAPES = {"w": (40, 50), "b": (50,)}


def _config(**keys):
    return RunConfig.from_flat({"method": "qsgd", "run_name": "t", **keys})


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g) * 0.01, "b": torch.randn(50, generator=g)}


def test_gamma_codes_round_trip_and_refuse_what_does_not_fit():
    values = np.array([1, 2, 3, 4, 7, 8, 255, 256, 2**40 + 3, 2**62, 2**63 - 1])
    prefix, low = gamma_bits(values)
    assert prefix.size + low.size == gamma_length(values) == sum(
        2 * (int(v).bit_length() - 1) + 1 for v in values)
    bits = np.concatenate([np.ones(3, np.uint8), prefix, low])
    back, end = read_gamma(bits, 3, values.size, 2**63 - 1)
    assert back.tolist() == values.tolist() and end == bits.size
    # 5 is 00101: the prefix 001, the low bits 01.
    assert [b.tolist() for b in gamma_bits(np.array([5]))] == [[0, 0, 1], [0, 1]]
    with pytest.raises(GammaError, match="longer than values up to 254 need"):
        read_gamma(bits, 3, values.size, 254)
    with pytest.raises(GammaError, match="a coded value 255 is above 200"):
        read_gamma(np.concatenate([*gamma_bits(np.array([3, 255]))]), 0, 2, 200)
    with pytest.raises(GammaError, match="truncated input"):
        read_gamma(bits[:-1], 3, values.size, 2**63 - 1)
    with pytest.raises(ValueError, match="positive integers"):
        gamma_bits(np.array([3, 0]))


def test_the_levels_are_unbiased_within_one_step_of_the_ratio():
    v = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    v[:7] = 0.0
    bucket, levels = 64, 4
    norms, idx, signed = quantize(v, bucket, levels, np.random.default_rng(0))
    assert norms.dtype == torch.float32 and norms.numel() == 16
    ratio = v.abs().to(torch.float64) / norms.to(torch.float64).repeat_interleave(bucket)[:1000]
    level = torch.zeros(1000, dtype=torch.int64)
    level[idx] = signed.abs()
    assert bool(((level - ratio * levels).abs() < 1).all()) and not bool((idx < 7).any())
    assert torch.equal(torch.sign(signed), torch.sign(v[idx]).to(torch.int64))
    # The mean of many draws approaches v (a rounding to the nearest level would not: levels
    # of 4 leave entries of |v| < norm / 8 at 0 for ever).
    rng = np.random.default_rng(2)
    total = torch.zeros(1000, dtype=torch.float64)
    draws = 2000
    for _ in range(draws):
        n, i, s = quantize(v, bucket, levels, rng)
        total[i] += dequantize(n, i, s, bucket, levels).to(torch.float64)
    err = float((total / draws - v).norm() / v.norm())
    assert err < 0.02, err


def test_a_payload_round_trips_at_under_3_bits_an_entry():
    config = _config()
    method = config.method
    update = method.compressor(config.train, 3).compress(_grads(), sequence=5)
    assert isinstance(update, LevelsUpdate) and update.bucket == 512 and update.levels == 16
    codec = method.codec(config.train)
    data = codec.encode(update)
    assert len(data) * 8 / 2050 < 3.0  # of 32 bits dense
    back = codec.decode(data, Bound(SHAPES, 5))
    codec.check(back, Bound(SHAPES, 5))
    assert back.sequence == 5
    for name, t in update.tensors.items():
        assert torch.equal(back.update.tensors[name].indices, t.indices)
        assert torch.equal(back.update.tensors[name].values, t.values)
    # Another round, another client: other draws.
    again = method.compressor(config.train, 3).compress(_grads(), sequence=6)
    other = method.compressor(config.train, 4).compress(_grads(), sequence=5)
    same = method.compressor(config.train, 3).compress(_grads(), sequence=5)
    assert codec.encode(same) == data
    assert codec.encode(again) != data and codec.encode(other) != data


def test_the_server_holds_clients_to_the_runs_bucket_and_levels():
    config = _config(**{"qsgd.levels": 4})
    update = config.method.compressor(config.train, 0).compress(_grads(), sequence=1)
    payload = LevelsCodec().decode(LevelsCodec().encode(update), Bound(SHAPES, 1))
    with pytest.raises(PayloadError, match="levels 4, the run's QSGD uses 16"):
        _config().method.codec(None).check(payload, Bound(SHAPES, 1))
    with pytest.raises(PayloadError, match="bucket size 512, the run's QSGD uses 64"):
        _config(**{"qsgd.levels": 4, "qsgd.bucket_size": 64}).method.codec(None).check(
            payload, Bound(SHAPES, 1))
    config.method.codec(None).check(payload, Bound(SHAPES, 1))
    with pytest.raises(PayloadError, match="tensor names differ"):
        config.method.codec(None).check(payload, Bound({"w": (40, 50), "c": (3,)}, 1))


def _message(tensors: list[bytes], bucket: int = 4, levels: int = 3,
             count: int | None = None) -> bytes:
    body = b"FGCQ\x01" + struct.pack("<QIII", 1, bucket, levels,
                                     len(tensors) if count is None else count)
    body += b"".join(tensors)
    return body + struct.pack("<I", zlib.crc32(body))


def _tensor(dims: tuple[int, ...], nonzero: int, norms: list[float], code: bytes,
            name: str = "w", code_bytes: int | None = None) -> bytes:
    return (struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<Q", nonzero)
            + struct.pack(f"<{len(norms)}f", *norms)
            + struct.pack("<Q", len(code) if code_bytes is None else code_bytes) + code)


def _bits(*bits: int) -> bytes:
    return np.packbits(np.array(bits, dtype=np.uint8), bitorder="little").tobytes()


# One entry at position 0 with level 1 and sign +: gap 1 ('1'), sign '0', level 1 ('1').
ONE = _bits(1, 0, 1)


@pytest.mark.parametrize(("data", "words"), [
    (_message([_tensor((2**40,), 0, [], b"")]), "above the bound"),
    (_message([_tensor((10,), 11, [1.0] * 3, ONE)]), "claims 11 of 10"),
    (_message([_tensor((10,), 1, [1.0] * 3, ONE)], bucket=1), "truncated input: the 10 norms"),
    (_message([_tensor((10,), 1, [-1.0, 1.0, 1.0], ONE)]), "negative, NaN or Inf"),
    (_message([_tensor((10,), 1, [float("nan"), 1.0, 1.0], ONE)]), "negative, NaN or Inf"),
    (_message([_tensor((10,), 1, [1.0] * 3, ONE, code_bytes=2**40)]), "truncated input"),
    (_message([_tensor((10,), 9, [1.0] * 3, ONE)]), "cannot fit in a code of 1 bytes"),
    # Level 4 ('00100') above levels 3.
    (_message([_tensor((10,), 1, [1.0] * 3, _bits(1, 0, 0, 0, 1, 0, 0))]), "longer than|above 3"),
    # A gap of 12 ('0001100') runs past 10 entries; so do two of 6 ('00110').
    (_message([_tensor((10,), 1, [1.0] * 3, _bits(0, 0, 0, 1, 1, 0, 0, 0, 1))]),
     "a coded value 12 is above 10"),
    (_message([_tensor((10,), 2, [1.0] * 3, _bits(0, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1))]),
     "positions run past its 10 entries"),
    (_message([_tensor((10,), 1, [1.0] * 3, _bits(1, 0, 1, 1))]), "padding must be zero"),
    (_message([_tensor((10,), 1, [1.0] * 3, ONE + b"\0")]), "padding must be zero"),
    (_message([_tensor((10,), 1, [0.0, 1.0, 1.0], ONE)]), "bucket of norm 0"),
    (_message([_tensor((10,), 0, [1.0] * 3, b"")], bucket=0), "must be at least 1"),
    (_message([_tensor((10,), 0, [1.0] * 3, b"")] * 2), "appears twice"),
    (_message([], count=2**31), "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, words):
    with pytest.raises(DecodeError, match=words):
        LevelsCodec().decode(data, Bound({"w": (10,)}))


def test_error_feedback_keeps_what_quantization_changed():
    config = _config(**{"qsgd.error_feedback": True, "qsgd.levels": 2})
    assert config.method.keeps_residual and not get("qsgd").keeps_residual
    comp = config.method.compressor(config.train, 0)
    grads = _grads()
    update = comp.compress(grads, sequence=1)
    for name, g in grads.items():
        sent = update.tensors[name].to_dense().reshape(-1)
        torch.testing.assert_close(sent + comp.residual()[name], g.reshape(-1), rtol=0,
                                   atol=1e-6)
    state = comp.state_dict()
    resumed = config.method.compressor(config.train, 0)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.residual()[n], comp.residual()[n]) for n in grads)
    before = comp.residual()["w"].clone()
    comp.restore(update)
    torch.testing.assert_close(comp.residual()["w"],
                               before + update.tensors["w"].to_dense().reshape(-1))


def _run(tmp_path, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=qsgd", "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_a_qsgd_federation_learns_with_and_without_its_residual_and_resumes(tmp_path):
    plain = _run(tmp_path, "plain", "rounds=4")
    assert float(plain[-1]["accuracy"]) > float(plain[0]["accuracy"]) + 0.1
    # Three QSGD replies of the digits MLP (15,010 entries): under a tenth of 32 bits an entry.
    assert int(plain[-1]["uplink_bytes"]) < 3 * 15010 * 4 / 10
    # With error feedback clients keep a residual: a resumed run is the whole one bit for bit.
    whole = _run(tmp_path, "whole", "rounds=4", "qsgd.error_feedback=true")
    _run(tmp_path, "part", "rounds=2", "qsgd.error_feedback=true")
    part = _run(tmp_path, "part", "rounds=4", "resume=true", "qsgd.error_feedback=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"]) + 0.1
    assert all(r["clients_aggregated"] == "3" and r["clients_rejected"] == "0"
               for r in plain + whole)
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    assert whole != plain
