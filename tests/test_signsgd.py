"""method = efsign (signSGD with error feedback) and method = signvote (signSGD with majority
vote), added through the Method contract (fedgc/methods/efsign.py, signvote.py), and their
``signs`` payload: the scaled sign and its residual, the votes and their coin flips, the wire's
bytes and bounds, the server's checks and vote, federations that learn and resume, and all three
catalogue methods of this change side by side under the emulator."""

from __future__ import annotations

import csv
import json
import struct
import zlib

import pytest
import torch

from client.app import initial_model, task_of
from dgc import DecodeError
from fedgc.methods import Bound, PayloadError, get
from fedgc.methods.efsign import SignsCodec, SignsUpdate
from fedgc.methods.signvote import SERVER_LR, MajorityVote
from fedgc.settings import RunConfig
from simulations.cli import main

SHAPES = {"w": (40, 50), "b": (50,)}


def _train(method: str):
    return RunConfig.from_flat({"method": method, "run_name": "t"}).train


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g)}


def test_ef_signsgd_sends_the_scaled_sign_and_keeps_the_rest():
    comp = get("efsign").compressor(_train("efsign"), 0)
    grads = _grads()
    grads["b"][:5] = 0.0
    update = comp.compress(grads, sequence=1)
    assert isinstance(update, SignsUpdate) and update.nnz == 2050
    for name, g in grads.items():
        p = g.reshape(-1)
        scale = float(p.abs().sum()) / p.numel()
        assert update.scales[name] == pytest.approx(scale, rel=1e-6)
        sent = update.tensors[name].to_dense().reshape(-1)
        assert torch.equal(sent.abs(), torch.full_like(sent, update.scales[name]))
        assert torch.equal(sent < 0, p < 0)  # an exact 0 goes as +scale
        torch.testing.assert_close(sent + comp.residual()[name], p, rtol=0, atol=1e-6)
    # The next round sends the sign of residual plus pseudo-gradient.
    kept = {n: r.clone() for n, r in comp.residual().items()}
    nxt = comp.compress(_grads(1), sequence=2)
    p = kept["w"] + _grads(1)["w"].reshape(-1)
    assert torch.equal(nxt.tensors["w"].values < 0, p < 0)
    # An update the server did not aggregate goes back whole; the state round-trips.
    resumed = get("efsign").compressor(_train("efsign"), 0)
    resumed.load_state_dict(comp.state_dict())
    before = comp.residual()["w"].clone()
    comp.restore(nxt)
    torch.testing.assert_close(comp.residual()["w"], before + nxt.tensors["w"].values)
    assert torch.equal(resumed.residual()["w"], before)


def test_the_wire_carries_one_bit_an_entry_and_a_scale_a_tensor():
    update = get("efsign").compressor(_train("efsign"), 0).compress(_grads(), sequence=9)
    codec = get("efsign").codec(_train("efsign"))
    data = codec.encode(update)
    # Preamble 17 and CRC 4; per tensor its name, ndim, dims, scale, then ceil(numel / 8) bytes.
    assert len(data) == 17 + 4 + (2 + 1 + 1 + 16 + 4 + 250) + (2 + 1 + 1 + 8 + 4 + 7)
    back = codec.decode(data, Bound(SHAPES, 9))
    codec.check(back, Bound(SHAPES, 9))
    assert back.sequence == 9 and back.scales == update.scales
    for name, t in update.tensors.items():
        assert torch.equal(back.update.tensors[name].values, t.values)
    with pytest.raises(PayloadError, match="tensor names differ"):
        codec.check(back, Bound({"w": (40, 50)}, 9))


def _message(tensors: list[bytes], count: int | None = None) -> bytes:
    body = b"FGCB\x01" + struct.pack("<QI", 1, len(tensors) if count is None else count)
    body += b"".join(tensors)
    return body + struct.pack("<I", zlib.crc32(body))


def _tensor(dims: tuple[int, ...], scale: float, signs: bytes, name: str = "w") -> bytes:
    return (struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<f", scale) + signs)


@pytest.mark.parametrize(("data", "words"), [
    (_message([_tensor((2**40,), 1.0, b"")]), "above the bound"),
    (_message([_tensor((10,), 1.0, b"\0")]), "truncated input: the signs of 'w' need 2"),
    (_message([_tensor((10,), -1.0, b"\0\0")]), "its scale is negative"),
    (_message([_tensor((10,), -0.0, b"\0\0")]), "its scale is negative"),
    (_message([_tensor((10,), float("inf"), b"\0\0")]), "its scale is NaN or Inf"),
    (_message([_tensor((10,), float("nan"), b"\0\0")]), "its scale is NaN or Inf"),
    (_message([_tensor((10,), 1.0, b"\0\x04")]), "padding after its last sign"),
    (_message([_tensor((10,), 1.0, b"\0\0")] * 2), "appears twice"),
    (_message([_tensor((10,), 1.0, b"\0\0\0")]), "trailing or oversized input"),
    (_message([], count=2**31), "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, words):
    with pytest.raises(DecodeError, match=words):
        SignsCodec().decode(data, Bound({"w": (10,)}))


def test_a_vote_is_signs_with_coin_flips_for_zeros_and_scale_one():
    train = _train("signvote")
    grads = _grads()
    grads["w"][0, :20] = 0.0
    votes = [get("signvote").compressor(train, key).compress(grads, sequence=r)
             for key, r in ((0, 1), (0, 1), (1, 1), (0, 2))]
    for v in votes:
        assert set(v.scales.values()) == {1.0}
        w = v.tensors["w"].values
        assert torch.equal(w[20:] < 0, grads["w"].reshape(-1)[20:] < 0)
    assert torch.equal(votes[0].tensors["w"].values, votes[1].tensors["w"].values)
    # Zeros flip a coin per client and round.
    assert not torch.equal(votes[0].tensors["w"].values[:20], votes[2].tensors["w"].values[:20])
    assert not torch.equal(votes[0].tensors["w"].values[:20], votes[3].tensors["w"].values[:20])
    # A vote weighed by its scale is refused; the server counts every client once.
    codec = get("signvote").codec(train)
    heavy = SignsUpdate(votes[0].tensors, 1, scales={"w": 2.0, "b": 1.0})
    heavy.tensors = {n: type(t)(t.indices, t.values * heavy.scales[n], t.shape)
                     for n, t in heavy.tensors.items()}
    payload = codec.decode(codec.encode(heavy), Bound(SHAPES, 1))
    with pytest.raises(PayloadError, match="tensor 'w' carries scale 2.0; a vote's signs"):
        codec.check(payload, Bound(SHAPES, 1))
    codec.check(codec.decode(codec.encode(votes[0]), Bound(SHAPES, 1)), Bound(SHAPES, 1))
    vote = get("signvote").aggregator(None)
    assert isinstance(vote, MajorityVote) and vote.weighted is False
    out = vote.finish({"w": torch.tensor([0.2, -0.6, 0.0])}, {"w": (3,)})
    assert out["w"].tolist() == [1.0, -1.0, 0.0]


def _run(tmp_path, method: str, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", f"method={method}", "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_an_efsign_federation_learns_and_resumes_bit_for_bit(tmp_path):
    whole = _run(tmp_path, "efsign", "whole", "rounds=4")
    _run(tmp_path, "efsign", "part", "rounds=2")
    part = _run(tmp_path, "efsign", "part", "rounds=4", "resume=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"]) + 0.1
    assert all(r["clients_aggregated"] == "3" and r["clients_rejected"] == "0" for r in whole)
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    # Three replies of the digits MLP (15,010 entries): about a bit an entry.
    assert int(whole[-1]["uplink_bytes"]) < 3 * (15010 / 8 + 200)


def test_a_vote_moves_every_entry_by_server_lr_or_not_at_all_and_learns(tmp_path):
    one = _run(tmp_path, "signvote", "one", "rounds=1", "server_lr=0.01")
    config = RunConfig.from_flat({"task": "digits", "method": "signvote", "run_name": "x"})
    start = initial_model(task_of(config.train.task_spec()), config.train.seed)
    after = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    moved = torch.cat([(after[k] - start[k]).reshape(-1).abs() for k in start])
    # Three voters never tie: every entry moves by server_lr, whatever the clients' weights.
    assert torch.allclose(moved, torch.full_like(moved, 0.01), rtol=1e-3)
    assert one[0]["clients_aggregated"] == "3"
    two = _run(tmp_path, "signvote", "two", "rounds=1", "server_lr=0.01", "clients_per_round=2")
    after = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    moved = torch.cat([(after[k] - start[k]).reshape(-1).abs() for k in start])
    still = moved == 0  # two voters that disagree: a tie, the entry stays
    assert torch.allclose(moved[~still], torch.full_like(moved[~still], 0.01), rtol=1e-3)
    assert 0.05 < float(still.float().mean()) < 0.95 and two[0]["clients_aggregated"] == "2"
    rows = _run(tmp_path, "signvote", "learns", "rounds=5", "server_lr=0.01")
    assert float(rows[-1]["accuracy"]) > float(rows[0]["accuracy"]) + 0.1
    summary = json.loads((tmp_path / "learns" / "summary.json").read_text())
    assert summary["config"]["server_lr"] == 0.01 and SERVER_LR < 0.01


def test_the_catalogue_runs_side_by_side_under_the_emulator(tmp_path, capsys):
    argv = ["compare", "--set", "task=digits", "--set", "sim.engine=local",
            "--set", "num_clients=6", "--set", "clients_per_round=3", "--set", "rounds=2",
            "--set", "progress=false", "--set", "netem.enabled=true",
            "--set", f"results_dir={tmp_path}", "--set", "run_name=cmp",
            "--methods", "dense,qsgd,efsign,signvote"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(doc["methods"]) == {"dense", "qsgd", "efsign", "signvote"}
    for name in ("efsign", "signvote"):
        assert doc["methods"][name]["uplink_vs_dense"] > 25
    assert doc["methods"]["qsgd"]["uplink_vs_dense"] > 10
    out = capsys.readouterr().out
    assert "EF-signSGD" in out and "signSGD-MV" in out and "QSGD" in out
    for name in ("qsgd", "efsign", "signvote"):
        rows = list(csv.DictReader((tmp_path / "cmp" / name / "rounds.csv").open()))
        assert float(rows[-1]["virtual_seconds"]) > 0
