"""method = randk: random-k with a shared seed and error feedback, added through the Method
contract alone (fedgc/methods/randk.py): indices from the seed, values on the wire, the residual
kept, the server's bound and checks, and a federation that learns and resumes."""

from __future__ import annotations

import csv
import json
import struct
import zlib

import numpy as np
import pytest
import torch

from dgc import DecodeError
from fedgc.methods import Bound, PayloadError
from fedgc.methods.randk import RandomKCodec, SeededUpdate, seeded_indices
from fedgc.settings import RunConfig
from simulations.cli import main


def _config(**keys) -> RunConfig:
    return RunConfig.from_flat({"method": "randk", "dgc.min_sparse_numel": 100,
                                "run_name": "t", **keys})


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g)}


@pytest.mark.parametrize(("numel", "k"), [(10, 3), (1000, 1), (1000, 999), (7, 7), (5, 9)])
def test_seeded_indices_are_k_distinct_sorted_positions_the_seed_fixes(numel, k):
    idx = seeded_indices(42, 3, numel, k)
    assert idx.dtype == np.int64 and len(idx) == min(k, numel)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < numel
    assert np.array_equal(idx, seeded_indices(42, 3, numel, k))
    if k < numel // 2:
        assert not np.array_equal(idx, seeded_indices(43, 3, numel, k))
        assert not np.array_equal(idx, seeded_indices(42, 4, numel, k))


def test_the_compressor_sends_the_residual_at_the_seeded_positions_and_keeps_the_rest():
    run = _config(density=0.05, **{"dgc.value_dtype": "float32"})
    method, train = run.method, run.train
    comp = method.compressor(train, client_key=3)
    grads = _grads()
    update = comp.compress(grads, sequence=1)
    assert isinstance(update, SeededUpdate)
    w, b = update.tensors["w"], update.tensors["b"]
    assert w.nnz == 100 and b.nnz == 50  # 5% of the matrix; the 50-entry bias goes whole
    assert torch.equal(w.indices, torch.from_numpy(seeded_indices(update.seed, 0, 2000, 100)))
    # Error feedback: what was sent and what is kept add up to the pseudo-gradient.
    sent = w.to_dense().reshape(-1)
    torch.testing.assert_close(sent + comp.residual()["w"], grads["w"].reshape(-1), rtol=0,
                               atol=0)
    # Another round, another client: other positions.
    again = method.compressor(train, client_key=3).compress(grads, sequence=2)
    other = method.compressor(train, client_key=4).compress(grads, sequence=1)
    assert not torch.equal(again.tensors["w"].indices, w.indices)
    assert not torch.equal(other.tensors["w"].indices, w.indices)
    # An update the server did not aggregate goes back whole.
    before = comp.residual()["w"].clone()
    comp.restore(update)
    torch.testing.assert_close(comp.residual()["w"], before + sent, rtol=0, atol=0)


def test_the_wire_carries_the_seed_and_the_values_not_the_indices():
    run = _config(density=0.05)
    method, train = run.method, run.train
    update = method.compressor(train, 0).compress(_grads(), sequence=5)
    codec = method.codec(train)
    data = codec.encode(update)
    # Preamble 29 (magic, version, sequence, seed, count, CRC), per tensor its name, dims,
    # k and dtype, then 2 bytes per float16 value: no index section at all.
    assert len(data) == 29 + (2 + 1 + 1 + 2 * 8 + 9) + (2 + 1 + 1 + 8 + 9) + 2 * (100 + 50)
    shapes = {"w": (40, 50), "b": (50,)}
    back = codec.decode(data, Bound(shapes, 5))
    codec.check(back, Bound(shapes, 5))
    assert back.sequence == 5 and back.update.seed == update.seed
    for name, t in update.tensors.items():
        assert torch.equal(back.update.tensors[name].indices, t.indices)
        assert torch.equal(back.update.tensors[name].values, t.values)
    # topk at the same density sends the same values plus their indices.
    top = RunConfig.from_flat({"method": "topk", "density": 0.05, "dgc.small_density": 0,
                               "dgc.min_sparse_numel": 100, "run_name": "t"})
    topk = top.method.codec(top.train).encode(
        top.method.compressor(top.train, 0).compress(_grads()))
    assert len(data) < len(topk)


def _message(tensors: list[bytes], count: int | None = None, seed: int = 9) -> bytes:
    body = b"FGCR\x01" + struct.pack("<QQI", 1, seed, len(tensors) if count is None else count)
    body += b"".join(tensors)
    return body + struct.pack("<I", zlib.crc32(body))


def _tensor(name: str, dims: tuple[int, ...], k: int, dtype: int, values: bytes) -> bytes:
    return (struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<QB", k, dtype) + values)


@pytest.mark.parametrize(("data", "words"), [
    (_message([_tensor("w", (2**40,), 2**30, 1, b"")]), "above the bound"),
    (_message([_tensor("w", (10,), 2**40, 1, b"\0\0")]), "claims 1099511627776 of 10"),
    (_message([_tensor("w", (10,), 4, 1, b"\0\0")]), "truncated input"),
    (_message([_tensor("w", (10,), 1, 7, b"\0\0")]), "unknown value dtype 7"),
    (_message([_tensor("w", (10,), 1, 1, b"\x00\x7c")]), "NaN or Inf"),
    (_message([_tensor("w", (10,), 1, 1, b"\0\0")] * 2), "appears twice"),
    (_message([_tensor("w", (10,), 1, 1, b"\0\0\0")]), "trailing or oversized input"),
    (_message([], count=2**31), "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, words):
    with pytest.raises(DecodeError, match=words):
        RandomKCodec().decode(data, Bound({"w": (10,)}))


def test_the_server_holds_every_client_to_the_k_it_sends():
    run = _config(density=0.05)
    codec = run.method.codec(run.train)
    shapes = {"w": (40, 50), "b": (50,)}
    greedy = SeededUpdate({"w": _dense(40 * 50, (40, 50)), "b": _dense(50, (50,))}, 1, seed=0)
    payload = codec.decode(codec.encode(greedy), Bound(shapes, 1))
    with pytest.raises(PayloadError, match="carries 2000 entries, random-k sends 100"):
        codec.check(payload, Bound(shapes, 1))
    with pytest.raises(PayloadError, match="tensor names differ"):
        codec.check(payload, Bound({"w": (40, 50), "c": (3,)}, 1))


def _dense(numel: int, shape: tuple[int, ...]):
    from dgc import SparseTensor

    return SparseTensor(torch.arange(numel), torch.ones(numel, dtype=torch.float16), shape)


def _run(tmp_path, name: str, *sets: str) -> None:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=randk", "--set", "density=0.05",
            "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0


def test_a_randk_federation_learns_resumes_bit_for_bit_and_is_not_a_default(tmp_path):
    _run(tmp_path, "whole", "rounds=4")
    _run(tmp_path, "part", "rounds=2")
    _run(tmp_path, "part", "rounds=4", "resume=true")
    rows = {n: list(csv.DictReader((tmp_path / n / "rounds.csv").open()))
            for n in ("whole", "part")}
    assert float(rows["whole"][-1]["accuracy"]) > float(rows["whole"][0]["accuracy"])
    for a, b in zip(rows["whole"], rows["part"], strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    clients = list(csv.DictReader((tmp_path / "whole" / "clients.csv").open()))
    assert all(r["status"] == "aggregated" for r in clients)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["method"] == "randk" and summary["uplink_compression"] > 15
    from fedgc.methods import compared, names

    assert "randk" in names() and "randk" not in compared()
