"""Issue 30's switches of dgc: values on the shared sets, bounded churn, sets ranked by
displacement, values on a grid, aged residuals, step-ahead, and the downlink's dead band."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

import dgc
from client.app import app as client_app
from client.state import ClientStateStore
from dgc import DecodeError, StateError
from dgc.signs import (
    SharedIndexPlanner,
    decode_mask,
    decode_shared,
    encode_mask,
    encode_signs,
    encode_values,
    take_signs,
    take_values,
)
from dgc.signs.client import on_grid
from dgc.signs.codec import decode_rank_request, encode_rank_request
from dgc.signs.planner import displacement_masks
from fedgc import protocol as P
from fedgc.settings import RunConfig
from fedgc.training import round_seed, train_locally
from server.downlink import Downlink
from server.local_grid import LocalGrid
from simulations.compare import reach, traffic_area

SHAPES = {"w": (20, 50), "head": (10, 20)}


def _grid_step(values: torch.Tensor) -> float:
    """The coarsest power of two every nonzero value is an integer multiple of."""
    nz = values[values != 0].double()
    e = math.floor(math.log2(float(nz.abs().min())))
    while not bool(torch.all(torch.remainder(nz, 2.0 ** e) == 0)):
        e -= 1
    return 2.0 ** e


# ----------------------------------------------------------------- values on the shared sets
def test_on_grid_rounds_to_the_power_of_two_nearest_mean_over_levels():
    v = torch.tensor([0.3, -0.05, 0.012, 0.0, -0.9])
    out = on_grid(v, levels=2.0)
    step = 2.0 ** round(math.log2(float(v.abs().mean()) / 2.0))  # mean 0.2524 -> 2**-3
    assert step == 0.125
    torch.testing.assert_close(out, (v / step).round() * step)
    assert not bool(torch.signbit(out[out == 0]).any())  # no -0.0 (the grid coding refuses it)
    assert on_grid(torch.zeros(4), 1.0).abs().sum() == 0
    big = on_grid(torch.tensor([1000.0, 0.001, 0.001, 0.001]), levels=64.0)
    assert float(big.abs().max()) <= 127 * _grid_step(big)  # clipped to the int8 range


def test_take_values_sends_grid_values_and_keeps_the_rounding():
    torch.manual_seed(0)
    residual = {"w": torch.randn(1000), "head": torch.randn(200) * 1e-3}
    before = {k: v.clone() for k, v in residual.items()}
    masks = {"w": np.arange(0, 1000, 7, dtype=np.int64), "head": np.array([3, 9, 150])}
    sent = take_values(residual, masks, sequence=4, levels=1.0)
    for name, t in sent.tensors.items():
        assert t.indices.tolist() == masks[name].tolist() and t.shape == (before[name].numel(),)
        # sent + kept = what was there, at the set and off it
        torch.testing.assert_close(t.values + residual[name][t.indices],
                                   before[name][t.indices])
        off = np.setdiff1d(np.arange(before[name].numel()), masks[name])
        assert torch.equal(residual[name][off], before[name][off])
    with pytest.raises(StateError, match="outside"):
        take_values(residual, {"w": np.array([1000])}, 1)
    with pytest.raises(StateError, match="does not hold"):
        take_values(residual, {"other": np.array([0])}, 1)


def test_values_cost_a_few_bits_each_and_decode_to_the_same_bits():
    torch.manual_seed(1)
    residual = {"w": torch.randn(1000) * 0.01}
    masks = {"w": np.sort(np.random.default_rng(0).choice(1000, 300, replace=False))}
    sent = take_values(residual, masks, sequence=9, levels=1.0)
    data = encode_values(sent)
    assert len(data) < 300 * 4 / 8 + 80  # ~2-3 bits a value (Rice-coded grid), no indices
    back = decode_shared(data, masks, {"w": (20, 50)})
    assert back.sequence == 9
    assert torch.equal(back.tensors["w"].indices, sent.tensors["w"].indices)
    assert torch.equal(back.tensors["w"].values, sent.tensors["w"].values)
    assert back.tensors["w"].shape == (20, 50)
    # decode_shared reads signs too (by their magic)
    signs = take_signs({"w": torch.randn(1000)}, masks, sequence=9)
    assert torch.equal(decode_shared(encode_signs(signs), masks, {"w": (20, 50)})
                       .tensors["w"].values, signs.tensors["w"].values)


def test_decode_shared_rejects_values_that_do_not_answer_the_sets():
    masks = {"w": np.arange(10, dtype=np.int64), "head": np.arange(4, dtype=np.int64)}
    sent = take_values({"w": torch.randn(1000), "head": torch.randn(200)}, masks, 2)
    shapes = {"w": (20, 50), "head": (10, 20)}
    good = encode_values(sent)
    decode_shared(good, masks, shapes)
    with pytest.raises(DecodeError, match="no values"):
        decode_shared(encode_values(dgc.SparseUpdate({"w": sent.tensors["w"]}, 2)), masks,
                      shapes)
    with pytest.raises(DecodeError, match="no shared index set"):
        decode_shared(good, {"w": masks["w"]}, shapes)
    with pytest.raises(DecodeError, match="holds 5"):
        decode_shared(good, {**masks, "head": np.arange(5)}, shapes)
    for cut in (3, len(good) // 2, len(good) - 1):
        with pytest.raises(DecodeError):
            decode_shared(good[:cut], masks, shapes)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    with pytest.raises(DecodeError):
        decode_shared(bytes(flipped), masks, shapes)


# ----------------------------------------------------------------- how the sets are chosen
def test_planner_bounds_how_much_of_a_set_changes_per_round():
    p = SharedIndexPlanner(SHAPES, density=0.05, churn=0.1)  # 50 entries of w, 5 may change
    first = torch.zeros(1000)
    first[:50] = torch.arange(50, 0, -1, dtype=torch.float32)  # ranks 0..49
    p.observe({"w": first.view(20, 50), "head": torch.ones(10, 20)})
    m1 = p.plan()["w"]
    assert m1.tolist() == list(range(50))
    second = torch.zeros(1000)
    second[500:600] = 1000.0  # a hundred stronger newcomers
    p.observe({"w": second.view(20, 50), "head": torch.ones(10, 20)})
    m2 = p.plan()["w"]
    assert len(m2) == 50 and len(np.setdiff1d(m2, m1)) == 5
    # the weakest five members (ranks 45..49 of the first aggregate) left
    assert sorted(np.setdiff1d(m1, m2).tolist()) == [45, 46, 47, 48, 49]
    # the bound survives a checkpoint
    q = SharedIndexPlanner(SHAPES, density=0.05, churn=0.1)
    q.load_state_dict(p.state_dict())
    p.observe({"w": second.view(20, 50), "head": torch.ones(10, 20)})
    q.observe({"w": second.view(20, 50), "head": torch.ones(10, 20)})
    assert p.plan()["w"].tolist() == q.plan()["w"].tolist()
    # churn 1 (the default) takes the best set
    free = SharedIndexPlanner(SHAPES, density=0.05)
    free.observe({"w": second.view(20, 50)})
    assert set(free.plan()["w"].tolist()) <= set(range(500, 600))  # ties: any 50 of them


def test_displacement_masks_rank_by_distance_from_version_0_with_ties_to_lower_index():
    initial = {"w": torch.zeros(20, 50)}
    model = {"w": torch.zeros(20, 50)}
    model["w"].view(-1)[[7, 3, 900, 12]] = torch.tensor([0.5, -0.5, 2.0, 0.25])
    masks = displacement_masks(model, initial, {"w": 3})
    assert masks["w"].tolist() == [3, 7, 900]  # |2.0| first, then the tie 3 / 7
    assert displacement_masks(model, initial, {"w": 6})["w"].tolist() == [0, 1, 3, 7, 12, 900]
    with pytest.raises(StateError, match="entries"):
        displacement_masks(model, initial, {"w": 0})
    with pytest.raises(StateError, match="entries"):
        displacement_masks(model, {"w": torch.zeros(3)}, {"w": 2})


def test_explored_sets_take_moved_entries_first_and_draw_the_rest_from_the_round():
    """``explore``: the displacement part takes only moved entries (at most count - explore),
    the rest is drawn from a seed of the round, the same at both ends, another each round;
    version 0 (nothing moved) gets a whole drawn set instead of the first indices."""
    initial = {"w": torch.zeros(20, 50)}
    model = {"w": torch.zeros(20, 50)}
    model["w"].view(-1)[[7, 3, 900, 12]] = torch.tensor([0.5, -0.5, 2.0, 0.25])
    masks = displacement_masks(model, initial, {"w": 10}, {"w": 5}, sequence=4)["w"]
    assert len(masks) == 10 and len(set(masks.tolist())) == 10
    assert {3, 7, 900, 12} <= set(masks.tolist())  # 4 moved: all taken, 6 drawn
    again = displacement_masks(model, initial, {"w": 10}, {"w": 5}, sequence=4)["w"]
    assert masks.tolist() == again.tolist()
    # only 2 of the 4 moved fit the displacement part of 10 - 8
    two = displacement_masks(model, initial, {"w": 10}, {"w": 8}, sequence=4)["w"].tolist()
    assert {900, 3} <= set(two) and len(set(two) & {7, 12}) <= 1  # 7, 12 only if drawn
    first = displacement_masks(initial, initial, {"w": 50}, {"w": 25}, sequence=1)["w"]
    other = displacement_masks(initial, initial, {"w": 50}, {"w": 25}, sequence=2)["w"]
    assert first.tolist() != list(range(50)) and first.tolist() != other.tolist()
    assert first.max() > 500  # drawn over the whole tensor, not its first entries
    with pytest.raises(StateError, match="expected 0 to 10"):
        displacement_masks(model, initial, {"w": 10}, {"w": 11})


def test_a_rank_request_carries_how_many_of_each_set_are_drawn():
    numels = {"a": 100, "b": 50}
    plain = encode_rank_request({"a": 10, "b": 5}, numels, 3, True)
    assert decode_rank_request(plain, numels) == (3, {"a": 10, "b": 5}, True, {})
    drawn = encode_rank_request({"a": 10, "b": 5}, numels, 3, False, {"a": 4, "b": 0})
    assert len(drawn) == len(plain) + 16
    assert decode_rank_request(drawn, numels) == (3, {"a": 10, "b": 5}, False,
                                                  {"a": 4, "b": 0})
    with pytest.raises(DecodeError, match="draws 11 of its 10"):
        decode_rank_request(encode_rank_request({"a": 10}, {"a": 100}, 3, False, {"a": 11}),
                            {"a": 100})


# ----------------------------------------------------------------- the downlink's dead band
def test_deadband_keeps_entries_the_model_hovers_around():
    model = OrderedDict(w=torch.zeros(4, 8), b=torch.zeros(4))
    model["w"][0, 0] = 1.0  # sets the int8 grid (step 2**-4)
    for band, moved in ((0.5, 3), (1.0, 2), (2.0, 1)):
        d = Downlink("auto", 10, density=1.0 - 1e-9, values="int8", deadband=band)
        d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
        step = 2.0 ** d.grid_exponents["w"]
        new = OrderedDict((k, v.clone()) for k, v in model.items())
        new["w"][1, :3] = torch.tensor([0.7, 1.3, 2.6]) * step  # 0.7, 1.3 and 2.6 steps away
        new["w"][2, 0] = 0.4 * step  # rounds to the same grid point: never moves
        held = d.sent_model["w"].clone()
        d.advance(new, new)
        assert int((d.sent_model["w"] != held).sum()) == moved, band
        # what the band holds back stays in the difference, within band + 1/2 step
        assert float((new["w"] - d.sent_model["w"]).abs().max()) <= (band + 0.5) * step


def test_float16_vectors_move_only_when_their_float16_value_moves():
    model = OrderedDict(w=torch.zeros(4, 8), b=torch.tensor([1.0, 2.0, 3.0]))
    model["w"][0, 0] = 1.0
    d = Downlink("auto", 10, density=0.5, values="int8", vectors="float16")
    d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
    new = OrderedDict((k, v.clone()) for k, v in model.items())
    new["b"] += torch.tensor([1e-5, 0.01, 0.0])  # below float16's step at 1.0, above, none
    d.advance(new, new)
    b = d.sent_model["b"]
    assert torch.equal(b, new["b"].to(torch.float16).to(torch.float32))
    assert d.changed_at["b"].tolist() == [0, 1, 0]  # only the entry whose float16 moved
    patch, _ = d.patch((0,))
    sent = dgc.decode(patch, max_numel=100).tensors["b"]
    assert sent.indices.tolist() == [1] and sent.values.dtype == torch.float16


# ----------------------------------------------------------------- the client, on real messages
def _settings(tmp_path, **kw) -> RunConfig:
    """A dgc run's keys with dgc's own keys ``kw`` (named without their ``dgc.`` prefix)."""
    return RunConfig.from_flat({
        "task": "digits", "num_clients": 3, "partition": "iid", "clients_per_round": 3,
        "density": 0.05, "dgc.warmup": "none", "method": "dgc", "run_name": "t",
        "results_dir": str(tmp_path), "state_dir": str(tmp_path / "state"),
        **{f"dgc.{k}": v for k, v in kw.items()}})


def _global(seed: int = 0) -> dict[str, torch.Tensor]:
    from tasks import get_task

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in get_task("digits").build_model().state_dict()
            .items()}


def _send(grid: LocalGrid, s: RunConfig, server_round: int, ack: int,
          model: dict[str, torch.Tensor], shared: bytes | None = None, **extra) -> Message:
    node = next(n for n, k in grid.partition_of.items() if k == 0)
    cfg = ConfigRecord({**s.client_config(), P.SERVER_ROUND: server_round, P.MODEL_VERSION: 0,
                        P.ACK_SEQUENCE: ack, P.DOWNLINK: "dense", **extra})
    content = RecordDict({P.ARRAYS: ArrayRecord(OrderedDict(model)), P.CONFIG: cfg})
    if shared is not None:
        content[P.SHARED] = P.bytes_to_record(shared, P.SHARED_MASK)
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=node,
                                              message_type=MessageType.TRAIN)])
    assert not reply.has_error(), reply.error.reason
    return reply


def _sent(reply: Message, shapes: dict, masks: dict | None = None) -> dict[str, torch.Tensor]:
    update = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                        max_numel=dgc.wire.MAX_NUMEL).to_dense()
    out = {k: update[k].reshape(-1).double() for k in update}
    if masks is not None:
        data = P.record_to_bytes(reply.content.array_records[P.SHARED], P.SHARED_SIGNS)
        for k, t in decode_shared(data, masks, shapes).to_dense().items():
            out[k] = out[k] + t.reshape(-1).double()
    return out


def _residual(s: RunConfig) -> dict[str, torch.Tensor]:
    c = s.method.compressor(s.train, 0)
    c.load_state_dict(ClientStateStore(s.train.state_dir).get("0")["compressor"])
    return {k: v.double() for k, v in c.residual().items()}


def _pseudo_gradient(run: RunConfig, server_round: int, sent: dict[str, torch.Tensor],
                     start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sent - local``, local trained from ``start`` exactly as client 0 trains."""
    from client.app import _partitions, task_of

    s = run.train
    task = task_of(s.task_spec(), None)  # None: any callable (the test's own settings)
    idx = torch.from_numpy(_partitions(s.task_spec(), None, s.num_clients, s.partition, s.alpha,
                                       s.seed)[0])
    model = task.build_model()
    model.load_state_dict(start)
    local = train_locally(model, task.train_x[idx], task.train_y[idx], task.training_loss,
                          lr=s.lr, batch_size=s.batch_size, local_epochs=s.local_epochs,
                          local_steps=s.local_steps, momentum=s.client_momentum,
                          weight_decay=s.weight_decay, seed=round_seed(s.seed, server_round, 0))
    return {k: (sent[k] - (start[k] - v)).reshape(-1).double()
            for k, v in local.pseudo_gradient.items()}


@pytest.mark.parametrize("kw", [dict(value_levels=4.0), dict(shared_values="grid"),
                                dict(shared_values="grid", value_levels=1.0),
                                dict(shared_first=True),
                                dict(shared_first=True, shared_values="grid")])
def test_grid_values_lose_no_mass(tmp_path, kw):
    """What a client sends (top-k update and shared values) plus what it keeps is exactly its
    pseudo-gradient (and, in its second round, its residual), with the top-k values on a
    power-of-two grid (``dgc.value_levels``), values at the shared sets (``dgc.shared_values =
    grid``), or the sets taken before the top-k (``dgc.shared_first``)."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, **kw)
    g = _global()
    shapes = {k: tuple(v.shape) for k, v in g.items()}
    masks = {"net.1.weight": np.arange(0, 12_800, 9, dtype=np.int64)}
    mask_bytes = encode_mask(masks, {"net.1.weight": 12_800}, 1)
    reply = _send(grid, s, 1, -1, g, shared=mask_bytes)
    sent = _sent(reply, shapes, masks)
    pg = _pseudo_gradient(s, 1, g, g)
    resid = _residual(s)
    for k in pg:
        torch.testing.assert_close(sent[k] + resid[k], pg[k], rtol=0, atol=1e-6)
    update = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                        max_numel=dgc.wire.MAX_NUMEL)
    if s.method.own.value_levels > 0:  # each tensor's values: int8 multiples of one power of two
        for t in update.tensors.values():
            assert t.values.dtype == torch.float32
            if bool((t.values != 0).any()):
                assert float(t.values.abs().max()) <= 127 * _grid_step(t.values)
    # The reply carries a value or sign at every entry of the round's sets (its metrics no
    # longer count them since issue 25's compact replies: the server reads the payload).
    shared = decode_shared(P.record_to_bytes(reply.content.array_records[P.SHARED],
                                             P.SHARED_SIGNS), masks, shapes)
    assert len(shared.tensors["net.1.weight"].indices) == len(masks["net.1.weight"])
    mask_bytes = encode_mask(masks, {"net.1.weight": 12_800}, 2)
    reply = _send(grid, s, 2, 1, g, shared=mask_bytes)
    sent2, resid2 = _sent(reply, shapes, masks), _residual(s)
    pg2 = _pseudo_gradient(s, 2, g, g)
    for k in pg2:
        torch.testing.assert_close(sent2[k] + resid2[k], resid[k] + pg2[k], rtol=0, atol=1e-5)
    if s.method.own.shared_first and s.method.own.shared_values == "grid":
        # The top-k spends fewer entries on the sets than in the usual order (with signs it
        # may spend more: a sign overshoots every entry smaller than the mean by the mean).
        def on_sets(reply: Message) -> int:
            update = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                                max_numel=dgc.wire.MAX_NUMEL)
            return len(np.intersect1d(update.tensors["net.1.weight"].indices.numpy(),
                                      masks["net.1.weight"]))

        usual = s.with_overrides({"dgc.shared_first": False,
                                  "state_dir": str(tmp_path / "usual")})
        _send(grid, usual, 1, -1, g, shared=encode_mask(masks, {"net.1.weight": 12_800}, 1))
        assert on_sets(reply) < on_sets(_send(grid, usual, 2, 1, g, shared=mask_bytes))


def test_step_ahead_trains_from_the_model_less_part_of_the_residual(tmp_path):
    """``dgc.step_ahead = a``: local training starts at ``model - a * residual``; the sent
    update plus the new residual is ``(1 - a)`` of the old residual plus the pseudo-gradient
    against the model sent (which carries the other ``a``), so nothing is lost."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, step_ahead=0.5)
    g = _global()
    _send(grid, s, 1, -1, g)
    before = _residual(s)
    assert any(float(v.abs().sum()) > 0 for v in before.values())
    g2 = _global(1)
    reply = _send(grid, s, 2, 1, g2)
    start = {k: g2[k] - 0.5 * before[k].float().view(g2[k].shape) if k in before else g2[k]
             for k in g2}
    pg = _pseudo_gradient(s, 2, g2, start)
    sent, after = _sent(reply, {}), _residual(s)
    for k in pg:
        torch.testing.assert_close(sent[k] + after[k], 0.5 * before[k] + pg[k], rtol=0,
                                   atol=1e-5)
    assert any(float(before[k].abs().sum()) > 0 and not torch.allclose(start[k], g2[k])
               for k in before)


@pytest.mark.parametrize("away, factor", [(0, 1.0), (1, 1.0), (3, 0.25)])
def test_aged_residual_decays_by_rounds_away(tmp_path, away, factor):
    """``dgc.residual_decay = 0.5`` after ``dgc.residual_after_rounds = 1``: a client back
    after ``away`` rounds away (0: sampled in consecutive rounds) keeps ``0.5 ** (away - 1)``
    of its residual."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, residual_decay=0.5, residual_after_rounds=1)
    g = _global()
    _send(grid, s, 1, -1, g)
    before = _residual(s)
    r2 = 2 + away
    reply = _send(grid, s, r2, 1, g)
    pg = _pseudo_gradient(s, r2, g, g)
    sent, after = _sent(reply, {}), _residual(s)
    for k in pg:
        torch.testing.assert_close(sent[k] + after[k], factor * before[k] + pg[k], rtol=0,
                                   atol=1e-5)


def test_client_ranks_shared_sets_by_displacement_as_the_server_does(tmp_path):
    """Sets ranked by displacement travel as their sizes only (``encode_rank_request``); the
    client ranks the model it holds against version 0, as the server does, and answers them."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path)
    version0 = _global(s.train.seed)
    g = {k: v.clone() for k, v in version0.items()}
    g["net.1.weight"].view(-1)[[5, 77, 4000]] += torch.tensor([1.0, -2.0, 0.5])
    numels = {k: v.numel() for k, v in g.items()}
    request = encode_rank_request({"net.1.weight": 3}, numels, 2, False)
    assert len(request) < 60
    reply = _send(grid, s, 2, -1, g, shared=request)
    masks = displacement_masks(g, version0, {"net.1.weight": 3})
    assert masks["net.1.weight"].tolist() == [5, 77, 4000]
    shared = decode_shared(P.record_to_bytes(reply.content.array_records[P.SHARED],
                                             P.SHARED_SIGNS), masks,
                           {k: tuple(v.shape) for k, v in g.items()})
    assert shared.tensors["net.1.weight"].indices.tolist() == [5, 77, 4000]
    # what the client keeps to fold its signs back is the sets themselves
    kept = bytes(ClientStateStore(s.train.state_dir).get("0")["pending_mask"].numpy()
                 .tobytes())
    assert decode_mask(kept, numels)[1]["net.1.weight"].tolist() == [5, 77, 4000]
    with pytest.raises(DecodeError, match="holds 0"):
        decode_rank_request(encode_rank_request({"net.1.weight": 0}, numels, 2, False), numels)
    with pytest.raises(DecodeError, match="expected"):
        decode_rank_request(request, {"net.1.weight": 10})


def test_a_federation_with_every_switch_aggregates_every_reply(tmp_path):
    """Sets ranked by displacement, values on them, top-k values on a grid, bounded churn and
    the dead band, in a real run: every reply is aggregated (the server decodes the values at
    the sets it computed) and the model learns."""
    from simulations.api import run

    result = run(config={"task": "digits", "num_clients": 10, "clients_per_round": 5,
                         "rounds": 6, "results_dir": str(tmp_path), "run_name": "all",
                         "progress": False},
                 sim__engine="local", dgc__shared_rank="displacement", dgc__shared_values="grid",
                 dgc__value_levels=4.0, downlink_deadband=1.0)
    assert result.summary["clients_rejected"] == 0
    assert all(r["clients_aggregated"] == 5 for r in result.rounds)
    assert result.summary["final_accuracy"] > 0.5


CA_SWITCHES = {"dgc__shared_rank": "displacement", "dgc__shared_values": "grid",
               "dgc__shared_levels": 0.5, "dgc__shared_first": True, "dgc__value_levels": 4.0,
               "downlink_vectors": "float16", "downlink_context": True}


def test_dgc_sets_is_dgc_with_its_switches_and_a_key_set_by_hand_wins(tmp_path):
    """``method = dgc_sets`` runs bit for bit as ``dgc`` with the seven switches written out
    (same accuracy and bytes every round), and a switch the user sets overrides its default."""
    from simulations.api import run

    base = {"task": "digits", "num_clients": 10, "clients_per_round": 5, "rounds": 4,
            "results_dir": str(tmp_path), "progress": False}
    preset = run(config={**base, "run_name": "preset", "method": "dgc_sets"},
                 sim__engine="local")
    spelt = run(config={**base, "run_name": "spelt", "method": "dgc"}, sim__engine="local",
                **CA_SWITCHES)
    plain = run(config={**base, "run_name": "plain", "method": "dgc"}, sim__engine="local")
    cols = ("accuracy", "uplink_bytes", "downlink_bytes")
    assert [[r[c] for c in cols] for r in preset.rounds] \
        == [[r[c] for c in cols] for r in spelt.rounds]
    assert [r["uplink_bytes"] for r in preset.rounds] != [r["uplink_bytes"] for r in plain.rounds]
    signs = run(config={**base, "run_name": "signs", "method": "dgc_sets"}, sim__engine="local",
                dgc__shared_values="sign")
    spelt_signs = run(config={**base, "run_name": "spelt-signs", "method": "dgc"},
                      sim__engine="local", **{**CA_SWITCHES, "dgc__shared_values": "sign"})
    assert [r["uplink_bytes"] for r in signs.rounds] \
        == [r["uplink_bytes"] for r in spelt_signs.rounds]


def test_phones_run_dgc_sets_with_its_switches_on_the_host():
    """Issue 39: dgc_sets is served by phones (its switches on the host around dgc's exported
    encoder, tests/test_phone_parity.py); a switch phones do not run is still refused."""
    from android_bridge.bridge_app import _phone_config
    from android_bridge.export import ConfigError, check_phone_run
    from fedgc.settings import RunConfig

    config = RunConfig.from_flat({"task": "digits", "method": "dgc_sets"})
    assert check_phone_run(config.method, config.server) is config.method
    task = _phone_config(config.train, config.method)
    assert task["values"] == {"first": 1.0, "shared_levels": 0.5, "levels": 4.0}
    assert task["dgc"]["selection"] == "exact"
    stepped = RunConfig.from_flat({"method": "dgc_sets", "dgc.step_ahead": 0.5})
    with pytest.raises(ConfigError, match="dgc.step_ahead=0.5"):
        check_phone_run(stepped.method, stepped.server)
    assert (config.method.own.value_levels, config.server.downlink_vectors) == (4.0, "float16")
    # half a grid step, the server's own dead band: a whole step lost 1.8 points on shakespeare
    assert config.server.downlink_deadband == 0.5


# ----------------------------------------------------------------- reading results
def test_traffic_area_is_accuracy_over_log_bytes_from_a_common_floor():
    curves = {"a": [(10, 0.5), (100, 0.8), (1000, 0.9)], "b": [(100, 0.7), (10_000, 0.95)]}
    area = traffic_area(curves)
    assert area["floor"] == 10
    assert area["area"]["a"] == pytest.approx(0.5 * 1 + 0.8 * 1)
    assert area["mean"]["a"] == pytest.approx(1.3 / 2)
    assert area["area"]["b"] == pytest.approx(0.7 * 2)  # 0 from the floor to its first round
    assert area["mean"]["b"] == pytest.approx(1.4 / 3)
    with pytest.raises(ValueError):
        traffic_area({"a": []})


def test_reach_reads_when_the_last10_mean_first_reaches_a_target():
    curve = [(100 * (i + 1), acc) for i, acc in enumerate([0.5] * 5 + [0.9] * 20)]
    # last-10 means: 0.5 up to round 5, then rising by 0.04 a round to 0.9 at round 15
    assert reach(curve, 0.7) == (10.0, 1000.0)
    assert reach(curve, 0.9) == (15.0, 1500.0)
    assert reach(curve, 0.5) == (1.0, 100.0)
    r, b = reach(curve, 0.95)
    assert math.isnan(r) and math.isnan(b)
