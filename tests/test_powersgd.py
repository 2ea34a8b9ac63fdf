"""method = powersgd: PowerSGD's low-rank factors with error feedback, through the Method
contract alone (fedgc/methods/powersgd.py): the hook's compression policy and orthogonalization,
the client's power step and residual, the server's warm start, the wire's bounds and checks, and
federations that learn, resume and run under the emulator."""

from __future__ import annotations

import csv
import json
import math
import struct
import zlib

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize_gram_schmidt,
    _should_compress,
)

from dgc import DecodeError, StateError
from fedgc.methods import Bound, PayloadError, compared, get, names, pending_parts
from fedgc.methods.powersgd import (
    LowRankCodec,
    LowRankTensor,
    LowRankUpdate,
    PowerSGDChannel,
    PowerSGDCompressor,
    PowerSGDSettings,
    decode_material,
    encode_material,
    factored,
    orthonormalize,
    product,
)
from fedgc.settings import RunConfig
from simulations.cli import main

SHAPES = {"fc1.weight": (20, 30), "fc1.bias": (20,), "fc2.weight": (3, 20), "conv": (8, 2, 3, 3)}


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _numels() -> dict[str, int]:
    return {n: math.prod(s) for n, s in SHAPES.items()}


@pytest.mark.parametrize("shape", [(20, 30), (3, 20), (4, 2, 3, 3), (2, 2), (1, 100), (100, 1),
                                   (64, 64, 3, 3), (20,)])
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0])
def test_the_tensors_compressed_are_the_hooks(shape, rank, rate):
    got = factored(shape, rank, rate)
    if len(shape) < 2:
        assert got is None  # vectors are sent whole, as the hook's uncompressed tensors
        return
    n, m = shape[0], math.prod(shape) // shape[0]
    r = min(n, m, rank)
    assert (got is not None) == _should_compress(n, m, r, rate)[0]
    assert got is None or got == (n, m, r)


def test_orthonormalize_is_the_hooks_gram_schmidt_and_never_nan():
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    ref = x.clone().unsqueeze(0)
    _orthogonalize_gram_schmidt(ref)
    torch.testing.assert_close(orthonormalize(x), ref[0], rtol=1e-5, atol=1e-6)
    q = orthonormalize(x)
    torch.testing.assert_close(q.T @ q, torch.eye(4), rtol=0, atol=1e-5)
    # A column with nothing left becomes zero, where the hook (epsilon 0) divides by zero.
    y = torch.stack([x[:, 0], torch.zeros(50), x[:, 1]], dim=1)
    out = orthonormalize(y)
    assert torch.isfinite(out).all() and torch.equal(out[:, 1], torch.zeros(50))
    torch.testing.assert_close(out[:, 2] @ out[:, 0], torch.tensor(0.0), rtol=0, atol=1e-6)
    assert torch.equal(orthonormalize(torch.zeros(5, 2)), torch.zeros(5, 2))


def _compressor(dtype=torch.float32, rank: int = 2, seed: int = 0) -> tuple[PowerSGDCompressor,
                                                                             PowerSGDChannel]:
    channel = PowerSGDChannel(SHAPES, PowerSGDSettings(rank=rank), seed)
    _, material = channel.plan(1)
    return PowerSGDCompressor(material, dtype), channel


def test_a_client_sends_one_power_step_and_keeps_exactly_what_it_missed():
    comp, channel = _compressor(torch.float16)
    assert set(channel.dims) == {"fc1.weight", "conv"}  # fc2 (3 x 20) saves less than 2x
    grads = _grads()
    update = comp.compress(grads, sequence=3)
    w = update.tensors["fc1.weight"]
    assert w.p.shape == (20, 2) and w.q.shape == (30, 2) and w.p.dtype == torch.float16
    m = grads["fc1.weight"]
    # P is orth(M Q) of the round's Q; Q_i = M^T P, both as sent (float16).
    q0 = channel.sent["fc1.weight"]
    torch.testing.assert_close(w.p.float(), orthonormalize(m @ q0), rtol=0, atol=1e-3)
    torch.testing.assert_close(w.q.float(), m.T @ w.p.float(), rtol=1e-3, atol=1e-2)
    assert update.tensors["fc1.bias"].whole is not None and update.tensors["conv"].rank == 2
    # Error feedback: the residual is the gradient less what the server reconstructs, bit for
    # bit (it is computed from the factors as sent).
    sent = update.parts()[0].to_dense()
    for name, g in grads.items():
        assert torch.equal(comp.residual()[name], g.reshape(-1) - sent[name].reshape(-1))
    # The residual enters the next round's matrix.
    again = comp.compress({n: torch.zeros(s) for n, s in SHAPES.items()}, sequence=4)
    assert again.tensors["fc1.weight"].q.abs().sum() > 0


def test_a_matrix_of_the_rank_is_sent_exactly():
    g = torch.Generator().manual_seed(2)
    low = torch.randn(20, 2, generator=g) @ torch.randn(2, 30, generator=g)
    grads = {**{n: torch.zeros(s) for n, s in SHAPES.items()}, "fc1.weight": low}
    comp, _ = _compressor(torch.float32)
    comp.compress(grads, sequence=1)
    assert float(comp.residual()["fc1.weight"].abs().max()) < 1e-4 * float(low.abs().max())


def test_an_update_the_server_did_not_aggregate_goes_back_whole():
    comp, _ = _compressor(torch.float16)
    grads = _grads()
    update = comp.compress(grads, sequence=1)
    data = LowRankCodec().encode(update)
    sequence, parts = pending_parts(get("powersgd"), RunConfig().train, data, None, None, SHAPES)
    assert sequence == 1
    for part in parts:
        comp.restore(part)
    for name, g in grads.items():
        torch.testing.assert_close(comp.residual()[name], g.reshape(-1), rtol=0, atol=1e-5)
    state = comp.state_dict()
    other, _ = _compressor(torch.float16)
    other.load_state_dict(state)
    assert all(torch.equal(other.residual()[n], comp.residual()[n]) for n in SHAPES)
    with pytest.raises(StateError, match="flat float tensors"):
        other.load_state_dict({"v": {"w": torch.zeros(2, 2)}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator (sim.device)")
def test_a_gradient_on_the_accelerator_gives_the_hosts_payload_and_residual():
    """With sim.device = cuda the gradients arrive on the accelerator; the factors, the residual
    and the wire's bytes are the host's, bit for bit those of the same gradients on the host."""
    grads = _grads()
    host, _ = _compressor(torch.float16)
    device, _ = _compressor(torch.float16)
    want = LowRankCodec().encode(host.compress(grads, sequence=2))
    on_device = {n: g.cuda() for n, g in grads.items()}
    got = LowRankCodec().encode(device.compress(on_device, sequence=2))
    assert got == want
    assert all(device.residual()[n].device.type == "cpu" for n in SHAPES)
    assert all(torch.equal(device.residual()[n], host.residual()[n]) for n in SHAPES)


def test_a_client_refuses_material_that_does_not_fit_its_model():
    comp = PowerSGDCompressor({"fc1.weight": torch.zeros(31, 2)}, torch.float16)
    with pytest.raises(StateError, match="has 31 rows"):
        comp.compress(_grads())
    comp = PowerSGDCompressor({"nope": torch.zeros(30, 2)}, torch.float16)
    with pytest.raises(StateError, match="the model lacks"):
        comp.compress(_grads())
    with pytest.raises(StateError, match="round's Q"):
        get("powersgd").compressor(None, 0, None)


def test_the_server_warm_starts_from_the_aggregate():
    channel = PowerSGDChannel(SHAPES, PowerSGDSettings(rank=2), 0)
    _, first = channel.plan(1)
    g = torch.Generator().manual_seed(3)
    low = torch.randn(20, 2, generator=g) @ torch.randn(2, 30, generator=g)
    channel.observe({**{n: torch.zeros(s) for n, s in SHAPES.items()}, "fc1.weight": low})
    _, second = channel.plan(2)
    q = second["fc1.weight"]
    # The next Q spans the aggregate's row space: its projection keeps the aggregate whole.
    torch.testing.assert_close(low @ q @ q.T, low, rtol=0, atol=2e-2 * float(low.abs().max()))
    # A tensor whose aggregate is zero keeps the Q it was sent (no zero column).
    assert torch.equal(second["conv"], first["conv"])
    # Without warm start every round draws anew; the draw is the seed's and the round's.
    cold = PowerSGDChannel(SHAPES, PowerSGDSettings(rank=2, warm_start=False), 0)
    assert torch.equal(cold.plan(1)[1]["fc1.weight"], first["fc1.weight"])
    assert not torch.equal(cold.plan(2)[1]["fc1.weight"], first["fc1.weight"])
    # The warm start is the channel's state, checked against the model.
    state = channel.state_dict()
    resumed = PowerSGDChannel(SHAPES, PowerSGDSettings(rank=2), 0)
    resumed.load_state_dict(state)
    assert resumed.plan(2)[0] == channel.plan(2)[0]
    with pytest.raises(ValueError, match="does not fit"):
        PowerSGDChannel(SHAPES, PowerSGDSettings(rank=1), 0).load_state_dict(state)


def test_the_wire_carries_the_factors_and_the_whole_tensors():
    comp, channel = _compressor(torch.float16)
    update = comp.compress(_grads(), sequence=5)
    codec = get("powersgd").codec(RunConfig.from_flat({"method": "powersgd"}).train)
    data = codec.encode(update)
    # Preamble 17 and CRC 4; per tensor its name, ndim, dims, rank u16 and dtype u8, then
    # 2 bytes per value: (20 + 30) * 2 and (8 + 18) * 2 factor entries, 20 + 60 whole ones.
    heads = sum(2 + len(n) + 1 + 8 * len(s) + 3 for n, s in SHAPES.items())
    assert len(data) == 21 + heads + 2 * ((20 + 30) * 2 + (8 + 18) * 2 + 20 + 60)
    assert update.nnz == (20 + 30) * 2 + (8 + 18) * 2 + 20 + 60
    material = channel.sent
    back = codec.decode(data, Bound(SHAPES, 5, material))
    codec.check(back, Bound(SHAPES, 5, material))
    assert back.sequence == 5 and back.nnz == update.nnz
    for name in update.tensors:
        torch.testing.assert_close(back.parts()[0].to_dense()[name],
                                   update.parts()[0].to_dense()[name], rtol=0, atol=0)
    assert back.norm() == pytest.approx(float(torch.sqrt(sum(
        v.double().square().sum() for v in update.parts()[0].to_dense().values()))))


def _message(tensors: list[bytes], count: int | None = None) -> bytes:
    body = b"FGCL\x01" + struct.pack("<QI", 1, len(tensors) if count is None else count)
    body += b"".join(tensors)
    return body + struct.pack("<I", zlib.crc32(body))


def _tensor(name: str, dims: tuple[int, ...], rank: int, dtype: int, values: bytes) -> bytes:
    return (struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<HB", rank, dtype)
            + values)


@pytest.mark.parametrize(("data", "words"), [
    (_message([_tensor("w", (2**40, 2**20), 1, 1, b"")]), "above the bound"),
    (_message([_tensor("w", (10, 10), 11, 1, b"")]), "claims rank 11"),
    (_message([_tensor("w", (100,), 1, 1, b"")]), "claims rank 1"),
    (_message([_tensor("w", (10, 10), 2**15, 1, b"\0\0")]), "claims rank"),
    (_message([_tensor("w", (10, 10), 1, 1, b"\0\0")]), "truncated input"),
    (_message([_tensor("w", (10,), 0, 7, b"\0\0")]), "unknown value dtype 7"),
    (_message([_tensor("w", (1,), 0, 1, b"\x00\x7c")]), "NaN or Inf"),
    (_message([_tensor("w", (1,), 0, 1, b"\0\0")] * 2), "appears twice"),
    (_message([_tensor("w", (1,), 0, 1, b"\0\0\0")]), "trailing or oversized input"),
    (_message([], count=2**31), "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, words):
    with pytest.raises(DecodeError, match=words):
        LowRankCodec().decode(data, Bound({"w": (10, 10)}))


def test_the_server_holds_a_reply_to_the_rounds_material():
    comp, channel = _compressor(torch.float16)
    codec = LowRankCodec()
    update = comp.compress(_grads(), sequence=1)
    material = channel.sent
    # A tensor sent whole where the round asked for factors, or factors of another rank.
    whole = LowRankUpdate({**update.tensors, "conv": LowRankTensor(
        SHAPES["conv"], whole=torch.zeros(144, dtype=torch.float16))}, 1)
    with pytest.raises(PayloadError, match="'conv' must come back at rank 2"):
        codec.check(codec.decode(codec.encode(whole), Bound(SHAPES, 1)), Bound(SHAPES, 1,
                                                                              material))
    low = LowRankUpdate({**update.tensors, "fc1.weight": LowRankTensor(
        (20, 30), p=torch.zeros(20, 1, dtype=torch.float16),
        q=torch.zeros(30, 1, dtype=torch.float16))}, 1)
    with pytest.raises(PayloadError, match="'fc1.weight' must come back at rank 2"):
        codec.check(codec.decode(codec.encode(low), Bound(SHAPES, 1)), Bound(SHAPES, 1,
                                                                             material))
    factors = LowRankUpdate({**update.tensors, "fc2.weight": LowRankTensor(
        (3, 20), p=torch.zeros(3, 1, dtype=torch.float16),
        q=torch.zeros(20, 1, dtype=torch.float16))}, 1)
    with pytest.raises(PayloadError, match="'fc2.weight' is sent as factors"):
        codec.check(codec.decode(codec.encode(factors), Bound(SHAPES, 1)), Bound(SHAPES, 1,
                                                                                 material))
    with pytest.raises(PayloadError, match="tensor names differ"):
        codec.check(codec.decode(codec.encode(update), Bound(SHAPES, 1)),
                    Bound({"fc1.weight": (20, 30)}, 1, material))


def test_the_round_material_is_read_against_the_model():
    q = {"fc1.weight": torch.ones(30, 2, dtype=torch.float16)}
    data = encode_material(4, q)
    assert len(data) == 21 + 2 + 10 + 8 + 3 + 2 * 60
    assert torch.equal(decode_material(data, _numels())["fc1.weight"], torch.ones(30, 2))
    for bad, words in [({"nope": torch.ones(30, 2)}, "not one of the model's"),
                       ({"fc1.weight": torch.ones(7, 2)}, "cannot take a Q of 7 rows"),
                       ({"fc1.weight": torch.ones(30, 21)}, "at rank 21"),
                       ({"fc1.weight": torch.full((30, 1), float("inf"))}, "NaN or Inf")]:
        with pytest.raises(DecodeError, match=words):
            decode_material(encode_material(1, bad), _numels())
    with pytest.raises(DecodeError, match="truncated input"):
        decode_material(data[:12], _numels())
    with pytest.raises(DecodeError, match="bad magic"):  # not a mask of DGC's
        get("dgc").read_material(data, _numels())


def test_the_product_is_the_same_bits_whatever_the_order():
    p = torch.randn(7, 3, generator=torch.Generator().manual_seed(4))
    q = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(product(p, q), product(p[:, [2, 0, 1]], q[:, [2, 0, 1]]))


def _run(tmp_path, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=powersgd", "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_a_powersgd_federation_learns_resumes_bit_for_bit_and_is_not_a_default(tmp_path):
    whole = _run(tmp_path, "whole", "rounds=5")
    _run(tmp_path, "part", "rounds=2")
    part = _run(tmp_path, "part", "rounds=5", "resume=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"]) + 0.2
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("whole", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    clients = list(csv.DictReader((tmp_path / "whole" / "clients.csv").open()))
    assert all(r["status"] == "aggregated" for r in clients)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["method"] == "powersgd" and summary["uplink_compression"] > 10
    # The round's Q is downlink: every client's bytes include it.
    assert all(int(r["downlink_bytes"]) > 0 for r in whole)
    assert "powersgd" in names() and "powersgd" not in compared()


def test_powersgd_runs_under_the_emulator(tmp_path):
    rows = _run(tmp_path, "emu", "rounds=5", "clients_per_round=4", "netem.enabled=true",
                "netem.mix=3g:0.5,edge:0.5", "netem.deadline_s=3", "netem.seed=3")
    # The deadline closes a round; the server's own work (measured) comes on top.
    assert all(0 < float(r["virtual_seconds"]) - float(r["round_server_s"]) <= 3 + 1e-9
               for r in rows)
    clients = list(csv.DictReader((tmp_path / "emu" / "clients.csv").open()))
    assert {r["status"] for r in clients} == {"aggregated", "dropped"}
    assert float(rows[-1]["accuracy"]) > float(rows[0]["accuracy"])


def test_bad_own_keys_stop_the_run_with_their_name(capsys):
    assert main(["run", "--set", "method=powersgd", "--set", "powersgd.rank=0"]) == 2
    assert "powersgd.rank" in capsys.readouterr().err
    assert main(["run", "--set", "method=powersgd", "--set", "powersgd.value_dtype=int8"]) == 2
    assert "powersgd.value_dtype" in capsys.readouterr().err
