"""method = tcs: time-correlated sparsification through the Method contract alone
(fedgc/methods/tcs.py): the server's mask from the last aggregate, values at it without indices,
a client top-k outside it, error feedback, the decoder's bound and the server's checks, and
federations that learn, resume bit for bit and run under the emulator with dropped replies."""

from __future__ import annotations

import csv
import json
import struct
import zlib

import numpy as np
import pytest
import torch

import dgc
from dgc import DecodeError, SparseTensor, SparseUpdate, StateError
from dgc.signs.codec import encode_mask
from dgc.signs.planner import SharedIndexPlanner
from fedgc.methods import Bound, PayloadError, get, pending_parts
from fedgc.methods.tcs import Budget, MaskedCodec, MaskedUpdate, largest
from fedgc.settings import RunConfig, SettingsError
from simulations.cli import main

SHAPES = {"w": (40, 50), "b": (50,), "out": (10, 30)}


def _config(**keys) -> RunConfig:
    return RunConfig.from_flat({"method": "tcs", "dgc.min_sparse_numel": 100,
                                "dgc.small_numel": 500, "run_name": "t", **keys})


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _method(config: RunConfig):
    return get("tcs").with_keys(config.own)


def _masks(seed: int = 1, k: int = 20) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": np.sort(rng.choice(2000, k, replace=False)).astype(np.int64),
            "out": np.sort(rng.choice(300, 9, replace=False)).astype(np.int64)}


def _rule_before_issue_39(score: torch.Tensor, k: int) -> torch.Tensor:
    """tcs.largest as written before its top-k path (the reference): the k-th value, every
    entry above it, then the entries equal to it in position order."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    kth = torch.topk(score, k, sorted=False).values.min()
    above = torch.nonzero(score > kth).reshape(-1)
    tied = torch.nonzero(score == kth).reshape(-1)[:k - above.numel()]
    return torch.sort(torch.cat([above, tied])).values


def _tied_scores(rng: np.random.Generator, kind: int) -> tuple[np.ndarray, list[int]]:
    """A score vector of one of five kinds and the k to try on it: continuous; few levels
    (ties everywhere); a tie straddling a chosen k-th; ties inside the top and just below it
    but not at the k-th; all equal. Sizes past 5000 may place the first tied entries beyond
    select_stable's first chunk. Zeros and the mask's -1 (TCSCompressor's) among them."""
    n = int(rng.integers(1, 2000)) if rng.random() < 0.8 else int(rng.integers(5000, 10_000))
    score = rng.random(n).astype(np.float32)
    ks = [0, 1, n - 1, n, int(rng.integers(0, n + 1))]
    if kind == 1:
        score = rng.choice(np.float32([-1.0, 0.0, 0.5, 1.0, 2.0]), n)
    elif kind in (2, 3) and n >= 8:
        where = rng.permutation(n)
        above = int(rng.integers(0, n // 2))
        tied = int(rng.integers(2, n - above + 1))
        score[where[:above]] = 2.0 + rng.random(above).astype(np.float32)
        if kind == 2:  # entries equal to the k-th on both sides of the cut
            score[where[above:above + tied]] = 1.5
            ks.append(above + int(rng.integers(1, tied)))
        else:  # a tie inside the top, one just below the cut, none at the k-th
            score[where[:above // 2]] = 2.5
            score[where[above:above + tied]] = 1.5
            ks += [above, above + tied]
    elif kind == 4:
        score = np.full(n, rng.choice(np.float32([0.0, -1.0, 0.25])), dtype=np.float32)
    return score, ks


@pytest.mark.parametrize("seed", range(4))
def test_largest_picks_the_set_of_its_rule_before_the_top_k_path_and_the_phones(seed):
    """Issue 39: tcs.largest takes torch.topk's set and resolves only a tie straddling the
    k-th; on 100 vectors a seed, with ties forced at the cut, inside and outside the top, all
    equal, k = 0 and k = n, it picks the set of the rule it replaced, of a stable descending
    sort and of the phone's numpy rule (android_bridge.host_encoders.largest_positions)."""
    from android_bridge.host_encoders import largest_positions

    # The tie's first entries far past the first chunk select_stable reads them in.
    late = torch.zeros(20_000)
    late[:5], late[-3 - seed:] = 2.0, 1.0
    assert largest(late, 6).tolist() == [0, 1, 2, 3, 4, 19_997 - seed]
    rng = np.random.default_rng(seed)
    for trial in range(100):
        score, ks = _tied_scores(rng, trial % 5)
        t = torch.from_numpy(score)
        order = torch.sort(t, descending=True, stable=True).indices
        for k in ks:
            got = largest(t, k)
            want = _rule_before_issue_39(t, k)
            assert got.dtype == torch.int64 and torch.equal(got, want), (trial, score.size, k)
            assert torch.equal(got, torch.sort(order[:k]).values), (trial, k)
            assert largest_positions(score, k).tolist() == got.tolist(), (trial, k)


def test_largest_refuses_nan_and_more_entries_than_there_are():
    """A NaN has no place in the order (torch.topk ranks it first): refused wherever it is and
    whatever k from 1 to n; k = 0 asks for nothing; k above the size is refused."""
    score = torch.tensor([0.5, float("inf"), 0.0, 2.0, -1.0, 0.5])
    for at in range(score.numel()):
        bad = score.clone()
        bad[at] = float("nan")
        for k in range(1, score.numel() + 1):
            with pytest.raises(ValueError, match=f"NaN at {at}"):
                largest(bad, k)
        assert largest(bad, 0).numel() == 0
    assert largest(score, 2).tolist() == [1, 3]
    with pytest.raises(ValueError, match="7 largest of 6 entries"):
        largest(score, 7)


def test_the_budget_counts_the_mask_as_the_servers_planner_does():
    budget = Budget(0.01, 0.03, 1000, 0.25)
    planner = SharedIndexPlanner({"big": (2000, 7), "small": (30, 30), "tiny": (7,)}, 0.01,
                                 0.03, 1000)
    for name, numel in (("big", 14000), ("small", 900), ("tiny", 7)):
        assert budget.mask(numel) == planner.count(name)
    assert budget.topk(14000, 140) == 35  # a quarter of the mask, rounded up
    assert budget.topk(14000, None) == 140 + 35  # no mask yet: the top-k takes its share too
    assert budget.topk(7, 1) == 1 and Budget(0.01, 0, 1, 0.0).topk(14000, 140) == 0


def test_the_client_sends_the_mask_values_and_its_top_k_outside_the_mask():
    config = _config(**{"dgc.value_dtype": "float32", "tcs.topk_share": 0.5})
    method, masks = _method(config), _masks()
    comp = method.compressor(config.train, 3, masks)
    grads = _grads()
    update = comp.compress(grads, sequence=4)
    assert isinstance(update, MaskedUpdate) and update.sequence == 4
    # The mask's values, at its indices, and no other entry of the mask.
    for name, mask in masks.items():
        sent = update.masked[name]
        assert torch.equal(sent.indices, torch.from_numpy(mask))
        assert torch.equal(sent.values, grads[name].reshape(-1)[sent.indices])
        outside = update.tensors[name].indices
        assert not np.isin(outside.numpy(), mask).any()
        # The top-k outside: as many as half the mask, the largest there.
        flat = grads[name].reshape(-1).abs().clone()
        flat[torch.from_numpy(mask)] = -1
        assert outside.numel() == -(-len(mask) // 2)
        assert torch.equal(outside, torch.sort(torch.topk(flat, outside.numel()).indices).values)
    # The bias (50 entries, under dgc.min_sparse_numel) goes whole; no mask is for it.
    assert update.tensors["b"].nnz == 50 and "b" not in update.masked
    assert torch.equal(update.tensors["b"].values, grads["b"]) and not comp.residual()["b"].any()
    assert update.nnz == 20 + 10 + 9 + 5 + 50
    # Error feedback: what was sent and what is kept add up to the pseudo-gradient.
    for name in ("w", "out"):
        sent = update.tensors[name].to_dense().reshape(-1) + \
            update.masked[name].to_dense().reshape(-1)
        torch.testing.assert_close(sent + comp.residual()[name], grads[name].reshape(-1),
                                   rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator (sim.device)")
def test_a_gradient_on_the_accelerator_gives_the_hosts_payload_and_residual():
    """With sim.device = cuda the gradients arrive on the accelerator; the mask's values, the
    top-k, the residual and the wire's bytes are the host's, bit for bit."""
    config = _config()
    method, grads = _method(config), _grads()
    host = method.compressor(config.train, 3, _masks())
    device = method.compressor(config.train, 3, _masks())
    codec = method.codec(config.train)
    want = codec.encode(host.compress(grads, sequence=2))
    got = codec.encode(device.compress({n: g.cuda() for n, g in grads.items()}, sequence=2))
    assert got == want
    assert all(device.residual()[n].device.type == "cpu" for n in SHAPES)
    assert all(torch.equal(device.residual()[n], host.residual()[n]) for n in SHAPES)


def test_without_a_mask_the_client_sends_its_top_k_of_both_shares():
    config = _config()  # density 0.01, tcs.topk_share 0.1, dgc.small_density 0.03
    update = _method(config).compressor(config.train, 0, None).compress(_grads(), sequence=1)
    assert update.masked == {}
    assert update.tensors["w"].nnz == 20 + 2  # 1% of 2000, and a tenth of that
    assert update.tensors["out"].nnz == 9 + 1  # the output layer at dgc.small_density


def test_the_wire_carries_the_mask_values_without_indices():
    config = _config()
    method, masks = _method(config), _masks(k=200)
    update = method.compressor(config.train, 0, masks).compress(_grads(), sequence=5)
    codec = method.codec(config.train)
    data = codec.encode(update)
    bare = dgc.encode(SparseUpdate(update.tensors, 5))
    # Preamble 9 (magic, version, count) and the CRC, per masked tensor its name, k and dtype,
    # then 2 bytes per float16 value; the rest is the FGCU message of the entries outside it.
    assert len(data) == 9 + 4 + (2 + 1 + 9 + 2 * 200) + (2 + 3 + 9 + 2 * 9) + len(bare)
    bound = Bound(SHAPES, 5, masks)
    back = codec.decode(data, bound)
    codec.check(back, bound)
    assert back.sequence == 5 and back.nnz == update.nnz
    assert len(back.parts()) == 2
    for name, t in update.masked.items():
        got = back.masked.tensors[name]
        assert got.shape == SHAPES[name]
        assert torch.equal(got.indices, t.indices) and torch.equal(got.values, t.values)
    # The same entries with their indices (what a top-k client pays) cost more.
    with_indices = {n: SparseTensor(*_merged(update.tensors[n], update.masked.get(n)),
                                    update.tensors[n].shape) for n in update.tensors}
    assert len(data) < len(dgc.encode(SparseUpdate(with_indices, 5)))


def _merged(a: SparseTensor, b: SparseTensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if b is None:
        return a.indices, a.values
    idx = torch.cat([a.indices, b.indices])
    order = torch.argsort(idx)
    return idx[order], torch.cat([a.values, b.values])[order]


def _message(records: list[bytes], rest: bytes, count: int | None = None) -> bytes:
    body = b"FGCV\x01" + struct.pack("<I", len(records) if count is None else count)
    body += b"".join(records) + rest
    return body + struct.pack("<I", zlib.crc32(body))


def _record(name: str, k: int, dtype: int, values: bytes) -> bytes:
    return struct.pack("<H", len(name)) + name.encode() + struct.pack("<QB", k, dtype) + values


_REST = dgc.encode(SparseUpdate({"w": SparseTensor(torch.tensor([5]), torch.ones(1), (10,))}, 2))
_MASK = {"w": np.array([1, 3], dtype=np.int64)}


@pytest.mark.parametrize(("data", "material", "words"), [
    (_message([_record("w", 2, 1, b"\0" * 4)], _REST), None, "has no mask this round"),
    (_message([_record("v", 2, 1, b"\0" * 4)], _REST), _MASK, "'v', which has no mask"),
    (_message([_record("w", 3, 1, b"\0" * 6)], _REST), _MASK, "3 values for 'w', its mask holds"),
    (_message([_record("w", 2, 9, b"\0" * 4)], _REST), _MASK, "unknown value dtype 9"),
    (_message([_record("w", 2, 1, b"\0\0\x00\x7c")], _REST), _MASK, "NaN or Inf"),
    (_message([_record("w", 2, 1, b"\0" * 4)] * 2, _REST), _MASK, "appear twice"),
    (_message([], _REST), _MASK, r"no values for \['w'\]"),
    (_message([_record("w", 2, 1, b"\0" * 3)], b""), _MASK, "truncated input"),
    (_message([_record("w", 2, 1, b"\0" * 4)], _REST + b"\0"), _MASK, "trailing or oversized"),
    (_message([_record("w", 2, 1, b"\0" * 4)], b""), _MASK, "truncated input"),
    (_message([], _REST, count=2**31), _MASK, "truncated input"),
])
def test_the_decoder_refuses_each_defect_before_allocating(data, material, words):
    with pytest.raises(DecodeError, match=words):
        MaskedCodec().decode(data, Bound({"w": (10,)}, 2, material))


def test_the_server_holds_every_client_to_its_top_k_and_outside_the_mask():
    config = _config()
    codec, masks = _method(config).codec(config.train), _masks()
    shapes = dict(SHAPES)

    def payload(outside: dict[str, list[int]]) -> bytes:
        rest = {n: SparseTensor(torch.tensor(outside.get(n, []), dtype=torch.int64),
                                torch.ones(len(outside.get(n, [])), dtype=torch.float16), s)
                for n, s in shapes.items()}
        masked = {n: SparseTensor(torch.from_numpy(m), torch.ones(len(m), dtype=torch.float16),
                                  shapes[n]) for n, m in masks.items()}
        return codec.encode(MaskedUpdate(rest, 1, masked=masked))

    bound = Bound(shapes, 1, masks)
    fine = codec.decode(payload({"w": [int(i) for i in range(2000) if i not in masks["w"]][:2]}),
                        bound)
    codec.check(fine, bound)
    greedy = codec.decode(payload({"w": [int(i) for i in range(2000)
                                         if i not in masks["w"]][:3]}), bound)
    with pytest.raises(PayloadError, match="carries 3 entries outside the mask, tcs sends at "
                                           "most 2"):
        codec.check(greedy, bound)
    inside = codec.decode(payload({"w": [int(masks["w"][0])]}), bound)
    with pytest.raises(PayloadError, match="sends entries of the mask with indices"):
        codec.check(inside, bound)
    with pytest.raises(PayloadError, match="tensor names differ"):
        codec.check(fine, Bound({**shapes, "c": (3,)}, 1, masks))


def test_state_round_trip_and_fold_back_of_an_update_the_server_did_not_aggregate():
    config = _config()
    method, masks = _method(config), _masks()
    comp = method.compressor(config.train, 0, None)
    comp.compress(_grads(0), sequence=1)
    before = {n: v.clone() for n, v in comp.residual().items()}
    state = comp.state_dict()
    comp = method.compressor(config.train, 0, masks)
    comp.load_state_dict(state)
    update = comp.compress(_grads(1), sequence=2)
    data = method.codec(config.train).encode(update)
    mask_bytes = encode_mask(masks, {n: int(np.prod(s)) for n, s in SHAPES.items()}, 2)
    # What the client stored, read as its fold-back reads it: against the mask it answered.
    sequence, parts = pending_parts(method, config.train, data, None, mask_bytes, SHAPES)
    assert sequence == 2 and len(parts) == 2
    for part in parts:
        comp.restore(part)
    # Everything is back in the residual (float16 values: sent and kept sum to what was held).
    for name, g in _grads(1).items():
        torch.testing.assert_close(comp.residual()[name], before[name] + g.reshape(-1))
    with pytest.raises(DecodeError, match="has no mask this round"):
        pending_parts(method, config.train, data, None, None, SHAPES)
    with pytest.raises(StateError, match="residual"):
        comp.load_state_dict({"u": {}})


def test_a_mask_the_client_cannot_answer_is_a_state_error_and_changes_nothing():
    config = _config()
    method = _method(config)
    for masks, words in (({"b": np.array([1])}, "sends whole"),
                         ({"x": np.array([1])}, "does not hold"),
                         ({"w": np.array([1, 2000])}, "falls outside")):
        comp = method.compressor(config.train, 0, masks)
        with pytest.raises(StateError, match=words):
            comp.compress(_grads())
        assert comp.residual() == {}


def test_the_mask_is_the_top_of_the_last_aggregate_and_survives_a_checkpoint():
    config = _config()
    method = _method(config)
    channel = method.channel(config, SHAPES)
    assert channel.plan(1) is None  # no aggregate yet: the first round's clients use top-k
    agg = {n: torch.randn(*s, generator=torch.Generator().manual_seed(2)) for n, s in
           SHAPES.items()}
    channel.observe(agg)
    data, masks = channel.plan(2)
    assert set(masks) == {"w", "out"}  # the bias is sent whole: no mask
    assert len(masks["w"]) == 20 and len(masks["out"]) == 9
    top = torch.topk(agg["w"].reshape(-1).abs(), 20).indices
    assert set(masks["w"].tolist()) == set(top.tolist())
    numels = {n: int(np.prod(s)) for n, s in SHAPES.items()}
    assert all(np.array_equal(a, masks[n]) for n, a in method.read_material(data, numels).items())
    # The last aggregate alone ranks the next mask (tcs.mask_momentum 0, the paper's).
    agg2 = {n: -t.roll(7) for n, t in agg.items()}
    channel.observe(agg2)
    again = method.channel(config, SHAPES)
    again.load_state_dict(channel.state_dict())
    later = channel.plan(3)[1]
    assert np.array_equal(again.plan(3)[1]["w"], later["w"])
    assert set(later["w"].tolist()) == set(torch.topk(agg2["w"].reshape(-1).abs(),
                                                      20).indices.tolist())


def test_bad_own_keys_are_refused_with_their_range():
    with pytest.raises(SettingsError, match=r"tcs.topk_share.*\[0, 1\]"):
        _config(**{"tcs.topk_share": 1.5})
    with pytest.raises(SettingsError, match=r"tcs.mask_momentum"):
        _config(**{"tcs.mask_momentum": 1.0})


def _run(tmp_path, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=tcs", "--set", "density=0.05",
            "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_a_tcs_federation_learns_resumes_bit_for_bit_and_is_not_a_default(tmp_path):
    whole = _run(tmp_path, "whole", "rounds=4")
    _run(tmp_path, "part", "rounds=2")
    part = _run(tmp_path, "part", "rounds=4", "resume=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"])
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    clients = list(csv.DictReader((tmp_path / "whole" / "clients.csv").open()))
    assert all(r["status"] == "aggregated" for r in clients)
    # From round 2 on the mask carries most entries: more entries per byte than round 1's.
    per_entry = {r["round"]: int(r["uplink_bytes"]) / int(r["nnz"]) for r in clients}
    assert per_entry["3"] < per_entry["1"]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["method"] == "tcs" and summary["uplink_compression"] > 5
    from fedgc.methods import compared, names

    assert "tcs" in names() and "tcs" not in compared()


def test_under_the_emulator_replies_not_aggregated_fold_back_against_their_mask(tmp_path):
    rows = _run(tmp_path, "emu", "rounds=6", "num_clients=12", "clients_per_round=4",
                "over_selection=1.5", "seed=5", "netem.enabled=true",
                "netem.mix=3g:0.5,edge:0.5", "netem.intermittent=0.5", "netem.deadline_s=30")
    assert all(float(r["virtual_seconds"]) > 0 for r in rows)
    clients = list(csv.DictReader((tmp_path / "emu" / "clients.csv").open()))
    assert any(r["status"] not in ("aggregated", "rejected") for r in clients)
    assert not any(r["status"] == "rejected" for r in clients)
    # A straggler's update (values at its round's mask) went back into its residual later.
    assert sum(int(r["restored"]) for r in clients) > 0


def test_the_emulators_stale_policy_reads_a_stored_payload_against_its_mask():
    from simulations.netem.staleness import StalePolicy, apply_stale_policy_to_record

    # The update folded back whole (tcs's own decay, tests/test_unaggregated.py, set aside).
    config = _config(**{"dgc.value_dtype": "float32", "unaggregated": "keep"})
    method, masks = _method(config), _masks()
    comp = method.compressor(config.train, 0, masks)
    update = comp.compress(_grads(), sequence=3)
    kept = {n: v.clone() for n, v in comp.residual().items()}
    numels = {n: int(np.prod(s)) for n, s in SHAPES.items()}

    def stored(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    record = {"compressor": comp.state_dict(),
              "pending": stored(method.codec(config.train).encode(update)),
              "pending_mask": stored(encode_mask(masks, numels, 3))}
    report = apply_stale_policy_to_record(record, 8, -1, StalePolicy("decay", 0.5, 2),
                                          lambda: method.compressor(config.train, 0), method,
                                          config.train)
    assert report.factor == 0.25 and "pending" not in record and "pending_mask" not in record
    aged = method.compressor(config.train, 0)
    aged.load_state_dict(record["compressor"])
    for name, g in _grads().items():  # the whole pseudo-gradient was back before the decay
        torch.testing.assert_close(aged.residual()[name], 0.25 * g.reshape(-1))
    assert not torch.equal(kept["w"], _grads()["w"].reshape(-1))  # it had been sent
