"""method = fetchsgd: count sketches from stateless clients, momentum and error accumulation in
sketch space on the server (fedgc/methods/fetchsgd.py): the hashes as docs/wire.md specifies
them, the sketch's linearity, the server's unsketch and state, the wire's bounds and checks, and
federations that learn, resume and run under the emulator."""

from __future__ import annotations

import csv
import json
import math
import struct
import zlib

import pytest
import torch

from dgc import DecodeError
from fedgc.methods import Bound, PayloadError, compared, get, names
from fedgc.methods.fetchsgd import (
    CountSketch,
    CountSketcher,
    FetchSGDSettings,
    SketchAggregator,
    SketchCodec,
    SketchPayload,
    fnv1a64,
    sketch_size,
)
from fedgc.settings import RunConfig
from server.aggregation import Combine
from simulations.cli import main

SHAPES = {"fc1.weight": (40, 50), "fc1.bias": (40,), "fc2.weight": (10, 40)}
D = 2000 + 40 + 400
M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_the_hashes_are_the_documented_ones():
    assert fnv1a64(b"") == 0xCBF29CE484222325 and fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    seed, rows, cols = 0x0123456789ABCDEF, 3, 7
    buckets, signs = CountSketch(seed, rows, cols).hashes("层.w", 5)
    first = _splitmix64(seed ^ fnv1a64("层.w".encode()))
    for j in range(rows):
        base = _splitmix64((first + j) & M64)
        for i in range(5):
            x = _splitmix64((base + i) & M64)
            assert int(buckets[j, i]) == x % cols
            assert float(signs[j, i]) == (-1.0 if x >> 63 else 1.0)


def _own(**keys) -> FetchSGDSettings:
    return FetchSGDSettings(**{"rows": 3, "columns": 0.2, "k": 0.01, **keys})


def _grads(seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_a_sketch_is_linear_and_the_servers_mean_is_the_sketch_of_the_mean():
    own = _own(value_dtype="float32")
    rows, cols, _ = sketch_size(own, SHAPES)
    assert (rows, cols) == (3, math.ceil(0.2 * D))
    a, b = _grads(1), _grads(2)
    sa = CountSketcher(own, 5).compress(a, sequence=1)
    sb = CountSketcher(own, 5).compress(b, sequence=1)
    assert sa.table.shape == (rows, cols) and sa.nnz == rows * cols
    assert sa.density == pytest.approx(rows * cols / D)
    agg = SketchAggregator(own, 5, 0.0)
    mean = Combine()([sa, sb], [1.0, 3.0], [1.0, 1.0], agg.space(SHAPES))
    want = CountSketch(5, rows, cols).sketch({n: (a[n] + 3 * b[n]) / 4 for n in SHAPES})
    torch.testing.assert_close(mean["sketch"], want, rtol=1e-5, atol=1e-5)
    # The order of the model's tensors does not enter: only names and entries do.
    turned = CountSketch(5, rows, cols).sketch(dict(reversed(list(a.items()))))
    torch.testing.assert_close(turned, sa.table, rtol=1e-5, atol=1e-5)


def test_the_server_applies_the_heavy_entries_and_keeps_the_rest_in_its_error_sketch():
    own = _own(value_dtype="float32", k=5 / D, columns=0.5)
    rows, cols, k = sketch_size(own, SHAPES)
    assert k == 5
    update = {n: torch.zeros(s) for n, s in SHAPES.items()}
    heavy = [("fc1.weight", 7, 9.0), ("fc1.weight", 1999, -8.0), ("fc1.bias", 3, 7.0),
             ("fc2.weight", 0, -6.0), ("fc2.weight", 399, 5.0)]
    for name, i, v in heavy:
        update[name].view(-1)[i] = v
    light = _grads(3, scale=0.01)
    agg = SketchAggregator(own, 11, 0.0)
    payload = CountSketcher(own, 11).compress({n: update[n] + light[n] for n in SHAPES})
    out = agg.finish(Combine()([payload], [1.0], [1.0], agg.space(SHAPES)), SHAPES)
    got = {(n, int(i)) for n, t in out.items() for i in t.reshape(-1).nonzero().reshape(-1)}
    assert got == {(n, i) for n, i, _ in heavy}
    for name, i, v in heavy:
        assert float(out[name].view(-1)[i]) == pytest.approx(v, abs=0.1)
    # The cells they hash to are cleared in both sketches; the light entries stay in the error.
    sketch = CountSketch(11, rows, cols)
    for name, i, _ in heavy:
        buckets, _ = sketch.hashes(name, math.prod(SHAPES[name]))
        for j in range(rows):
            assert float(agg.e[j, buckets[j, i]]) == 0.0 and float(agg.u[j, buckets[j, i]]) == 0.0
    assert float(agg.e.abs().sum()) > 0
    # A round of nothing applies what the error kept: its own heaviest entries.
    zero = CountSketcher(own, 11).compress({n: torch.zeros(s) for n, s in SHAPES.items()})
    again = agg.finish(Combine()([zero], [1.0], [1.0], agg.space(SHAPES)), SHAPES)
    assert sum(int((t != 0).sum()) for t in again.values()) == k
    assert max(float(t.abs().max()) for t in again.values()) < 0.2


def test_the_servers_momentum_lives_in_the_sketch_and_its_state_resumes():
    own = _own(value_dtype="float32")
    agg = SketchAggregator(own, 2, 0.9)
    space = agg.space(SHAPES)
    sketches = [CountSketcher(own, 2).compress(_grads(s)) for s in range(3)]
    first = agg.finish(Combine()([sketches[0]], [1.0], [1.0], space), SHAPES)
    assert sum(int((t != 0).sum()) for t in first.values()) == sketch_size(own, SHAPES)[2]
    state = agg.state_dict()
    resumed = SketchAggregator(own, 2, 0.9)
    resumed.load_state_dict(state)
    for s in sketches[1:]:
        a = agg.finish(Combine()([s], [1.0], [1.0], space), SHAPES)
        b = resumed.finish(Combine()([s], [1.0], [1.0], space), SHAPES)
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    # Momentum: the same sketch again moves the momentum sketch by rho * u + s.
    u = agg.u.clone()
    agg.finish(Combine()([sketches[0]], [1.0], [1.0], space), SHAPES)
    moved = agg.u != 0
    torch.testing.assert_close(agg.u[moved], (0.9 * u + sketches[0].table)[moved], rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="differ"):
        resumed.load_state_dict({"momentum": torch.zeros(3, 4), "error": None})


def test_the_wire_carries_the_table_and_the_seed():
    train = RunConfig.from_flat({"method": "fetchsgd", "seed": 4}).train
    method = get("fetchsgd")
    payload = method.compressor(train, 0).compress(_grads(), sequence=5)
    codec = method.codec(train)
    data = codec.encode(payload)
    rows, cols, _ = sketch_size(method.own, SHAPES)
    assert (rows, cols) == (5, math.ceil(0.076 * D))
    # magic, version, sequence, seed, rows, cols, dtype: 30 bytes; 2 per float16 cell; CRC.
    assert len(data) == 30 + 2 * rows * cols + 4
    back = codec.decode(data, Bound(SHAPES, 5))
    codec.check(back, Bound(SHAPES, 5))
    assert back.sequence == 5 and back.seed == 4 and torch.equal(back.table, payload.table)
    other = SketchCodec(method.own, seed=5)
    with pytest.raises(PayloadError, match="seed 4, this run's hashes use 5"):
        other.check(back, Bound(SHAPES, 5))
    bigger = SketchCodec(FetchSGDSettings(rows=6), seed=4)
    with pytest.raises(DecodeError, match="this run's sketch is 6 x"):
        bigger.decode(data, Bound(SHAPES, 5))


def _message(rows: int, cols: int, dtype: int, values: bytes, seed: int = 4) -> bytes:
    body = b"FGCH\x01" + struct.pack("<QQIIB", 1, seed, rows, cols, dtype) + values
    return body + struct.pack("<I", zlib.crc32(body))


C = sketch_size(FetchSGDSettings(), SHAPES)[1]  # 186 columns, 5 rows: 930 cells


@pytest.mark.parametrize(("data", "words"), [
    (_message(2**31, 2**31, 1, b""), "above the bound"),
    (_message(5, C + 1, 1, b""), "above the bound"),
    (_message(5, C, 1, b"\0\0"), "truncated input"),
    (_message(5, C, 9, b"\0\0" * 5 * C), "unknown value dtype 9"),
    (_message(5, C, 1, b"\x00\x7c" * 5 * C), "NaN or Inf"),
    (_message(5, C, 1, b"\0\0" * (5 * C + 1)), "trailing or oversized input"),
    (_message(5, C, 1, b"\0\0" * 5 * C)[:20], "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, words):
    codec = SketchCodec(FetchSGDSettings(), seed=4)
    with pytest.raises(DecodeError, match=words):
        codec.decode(data, Bound(SHAPES, 1))


def test_the_payload_is_a_sketch_and_the_client_keeps_nothing():
    sketcher = CountSketcher(_own(), 0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        sketcher.compress({"w": torch.tensor([1.0, float("nan")])})
    assert sketcher.state_dict() == {} and sketcher.residual() == {}
    # Without the run's keys a sketch is bounded by the model's largest tensor.
    with pytest.raises(DecodeError, match="above the bound 2000"):
        SketchCodec().decode(_message(2**31, 2**31, 1, b""), Bound(SHAPES))
    with pytest.raises(PayloadError, match="not a sketch"):
        SketchCodec(_own()).check(object(), Bound(SHAPES))
    with pytest.raises(TypeError, match="SketchPayload"):
        SketchCodec().encode({"w": torch.zeros(3)})
    assert isinstance(CountSketcher(_own(), 0).compress(_grads()), SketchPayload)
    assert not get("fetchsgd").keeps_residual


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator (sim.device)")
def test_a_gradient_on_the_accelerator_is_sketched_on_the_host():
    """With sim.device = cuda the gradients arrive on the accelerator; the hashes are the host's,
    and the sketch is bit for bit the same gradients' sketch on the host."""
    grads = _grads()
    want = CountSketcher(_own(), 0).compress(grads, sequence=1)
    got = CountSketcher(_own(), 0).compress({n: g.cuda() for n, g in grads.items()}, sequence=1)
    codec = SketchCodec(_own())
    assert codec.encode(got) == codec.encode(want)


def _run(tmp_path, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=fetchsgd", "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_a_fetchsgd_federation_learns_resumes_bit_for_bit_and_is_not_a_default(tmp_path):
    whole = _run(tmp_path, "whole", "rounds=5")
    _run(tmp_path, "part", "rounds=2")
    part = _run(tmp_path, "part", "rounds=5", "resume=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"]) + 0.15
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("whole", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The server applies k entries a round: the model moves there only.
    assert all(int(r["clients_aggregated"]) == 3 for r in whole)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["method"] == "fetchsgd" and summary["density"] == pytest.approx(0.38)
    assert "fetchsgd" in names() and "fetchsgd" not in compared()


def test_fetchsgd_runs_under_the_emulator_with_a_robust_combine(tmp_path):
    rows = _run(tmp_path, "emu", "rounds=4", "clients_per_round=4", "netem.enabled=true",
                "netem.mix=3g:0.5,edge:0.5", "netem.deadline_s=3", "netem.seed=3",
                "aggregation=median")
    # The deadline closes a round; the server's own work (measured) comes on top.
    assert all(0 < float(r["virtual_seconds"]) - float(r["round_server_s"]) <= 3 + 1e-9
               for r in rows)
    clients = list(csv.DictReader((tmp_path / "emu" / "clients.csv").open()))
    assert {r["status"] for r in clients} == {"aggregated", "dropped"}
    assert float(rows[-1]["accuracy"]) > float(rows[0]["accuracy"])


def test_bad_own_keys_stop_the_run_with_their_name(capsys):
    assert main(["run", "--set", "method=fetchsgd", "--set", "fetchsgd.rows=0"]) == 2
    assert "fetchsgd.rows" in capsys.readouterr().err
    assert main(["run", "--set", "method=fetchsgd", "--set", "fetchsgd.k=1.5"]) == 2
    assert "fetchsgd.k" in capsys.readouterr().err
