"""Method.unaggregated: what a client folds back of an update the server never aggregated."""

from __future__ import annotations

import csv

import pytest
import torch

from client.app import app as client_app
from client.state import ClientStateStore, fold_back_pending
from dgc import DGCCompressor, DGCConfig, encode
from fedgc.methods import get, pending_parts, registered
from fedgc.methods.unaggregated import fold_back, folded_share
from fedgc.schema import SettingsError
from fedgc.settings import RunConfig
from server.app import run_server
from server.local_grid import LocalGrid

BASE = {"task": "digits", "num_clients": 3, "clients_per_round": 3, "partition": "iid",
        "progress": False, "local_steps": 3, "method": "stc", "rounds": 2}


def _dropped_update(seed: int = 1) -> tuple[DGCCompressor, object, torch.Tensor]:
    """A compressor that sent an update (round 3), the update and the residual it left."""
    c = DGCCompressor(DGCConfig(density=0.1, warmup="none"))
    g = torch.Generator().manual_seed(seed)
    sent = c.compress({"w": torch.randn(40, 50, generator=g)}, sequence=3)
    return c, sent, c.memory.v["w"].clone()


@pytest.mark.parametrize("mode, age, share", [
    ("keep", 7, 1.0), ("discard", 1, 0.0), ("decay", 1, 0.5), ("decay", 3, 0.125)])
def test_each_policy_folds_back_its_share_of_the_update_alone(mode, age, share):
    c, sent, waited = _dropped_update()
    update = sent.tensors["w"].to_dense().reshape(-1).float()
    got = fold_back(c, [sent], lambda f, r: folded_share(mode, 0.5, 1.0, age, f, r))
    assert got == share
    # What merely waited in the residual stays whole; the update counts ``share`` of itself.
    torch.testing.assert_close(c.memory.v["w"], waited + share * update)


def test_cap_bounds_the_folded_update_by_the_residual_it_joins():
    c, sent, waited = _dropped_update()
    update = sent.tensors["w"].to_dense().reshape(-1).float()
    ratio = float(update.norm() / waited.norm())
    assert ratio > 0.3  # the top-k carries a good part of the mass: the cap below acts
    share = fold_back(c, [sent], lambda f, r: folded_share("cap", 0.5, 0.3, 1, f, r))
    assert share == pytest.approx(0.3 / ratio, rel=1e-5)
    assert float((c.memory.v["w"] - waited).norm()) == pytest.approx(0.3 * float(waited.norm()),
                                                                     rel=1e-4)
    # A cap the update is within folds it back whole.
    c, sent, waited = _dropped_update()
    assert fold_back(c, [sent], lambda f, r: folded_share("cap", 0.5, ratio * 1.01, 1, f, r)) \
        == 1.0


def test_a_share_outside_0_1_is_refused_before_the_residual_is_changed():
    c, sent, _ = _dropped_update()
    with pytest.raises(ValueError, match=r"in \[0, 1\], got 1.5"):
        fold_back(c, [sent], lambda f, r: 1.5)
    with pytest.raises(ValueError, match="unaggregated must be one of"):
        folded_share("sometimes", 0.5, 1.0, 1, 1.0, 1.0)


def test_fold_back_pending_ages_the_update_from_its_round():
    """The age is the rounds since the update was computed: decay ** (round - its sequence);
    an acknowledged update is not folded back, an unaggregated one discarded reports nothing."""
    method = get("dgc")
    train = RunConfig.from_flat({"run_name": "t", "method": "dgc"}).train
    assert train.unaggregated == "decay" and train.unaggregated_decay == 0.5
    shapes = {"w": (2000,)}
    for server_round, share in ((4, 0.5), (6, 0.125)):
        c, sent, waited = _dropped_update()
        record = {"pending": encode(sent)}
        assert fold_back_pending(c, record_state(record), -1, shapes, method, train, server_round)
        update = sent.tensors["w"].to_dense().reshape(-1).float()
        torch.testing.assert_close(c.memory.v["w"], waited + share * update)
    c, sent, waited = _dropped_update()
    assert not fold_back_pending(c, record_state({"pending": encode(sent)}), 3, shapes, method,
                                 train, 9)
    discard = RunConfig.from_flat({"run_name": "t", "method": "dgc",
                                   "unaggregated": "discard"}).train
    assert not fold_back_pending(c, record_state({"pending": encode(sent)}), -1, shapes, method,
                                 discard, 9)
    torch.testing.assert_close(c.memory.v["w"], waited)


def record_state(record: dict) -> dict:
    """``record``'s bytes as the store keeps them (uint8 tensors)."""
    return {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in record.items()}


def test_every_error_feedback_method_of_the_catalogue_has_a_default_that_acts():
    for method in registered():
        filled = RunConfig.from_flat({"run_name": "t", "method": method.name}).train
        if method.keeps_residual or method.name == "qsgd":  # qsgd: with qsgd.error_feedback
            assert filled.unaggregated == "decay", method.name
        else:  # nothing to fold back: the key is never read
            assert filled.unaggregated == "keep", method.name
    assert {m.name for m in registered() if m.keeps_residual} >= {
        "dgc", "dgc_sets", "stc", "randk", "tcs", "efsign", "powersgd"}
    # A method that gives no default (dense, or one of your own) folds back whole, as before.
    assert RunConfig.from_flat({"run_name": "t", "method": "dense"}).train.unaggregated == "keep"


@pytest.mark.parametrize("key, value, words", [
    ("unaggregated", "sometimes", "unaggregated = 'sometimes'"),
    ("unaggregated_decay", 1.5, "unaggregated_decay = 1.5 is outside the accepted range"),
    ("unaggregated_cap", -1.0, "unaggregated_cap = -1.0 is outside the accepted range"),
])
def test_bad_values_are_refused_naming_the_key(key, value, words):
    with pytest.raises(SettingsError, match=words):
        RunConfig.from_flat({"run_name": "t", key: value})


def _run(tmp_path, name: str, **keys) -> tuple[dict[int, torch.Tensor], int, dict]:
    """A 2-round stc run on the in-process engine whose client 0 loses its round-1 reply;
    what client 0 carried into round 2's compression (its residual after it plus what it sent:
    the residual it started from, the folded-back update's share and its pseudo-gradient), the
    client key lost and the clients.csv rows."""
    grid = LocalGrid(client_app, 3)

    def drop_client_0_in_round_1(reply):
        if reply.metadata.message_type == "train" and int(reply.metadata.group_id) == 1 \
                and grid.partition_of[reply.metadata.src_node_id] == 0:
            return None  # as if its uplink failed
        return reply

    grid.intercept = drop_client_0_in_round_1
    c = RunConfig.from_flat({**BASE, "results_dir": str(tmp_path), "run_name": name, **keys})
    run_server(grid, c)
    method = get("stc").with_keys({})
    train = c.train
    state = ClientStateStore(c.run_dir / "client_state").load("0")
    compressor = method.compressor(train, 0)
    compressor.load_state_dict(state.compressor)
    residual = compressor.residual()
    sequence, parts = pending_parts(method, train, state.pending, None, None,
                                    {n: (v.numel(),) for n, v in residual.items()})
    assert sequence == 2
    carried = {n: v.clone() for n, v in residual.items()}
    for part in parts:
        for n, t in part.tensors.items():
            carried[n] += t.to_dense().reshape(-1).float()
    rows = {(int(r["round"]), int(r["client_key"])): r
            for r in csv.DictReader((c.run_dir / "clients.csv").open())}
    return carried, 0, rows


def test_a_dropped_client_folds_back_what_its_method_keeps(tmp_path):
    """Real runs: the round-1 update of client 0 is lost; in round 2 the server's ack tells it,
    and it folds back all of it (keep), half (stc's default: decay 0.5, one round old) or none
    (discard). Everything else being equal, what it carries differs by that share of the update."""
    keep, lost, rows = _run(tmp_path, "keep", unaggregated="keep")
    assert rows[(1, lost)]["status"] == "timeout" and rows[(2, lost)]["restored"] == "1"
    assert all(rows[(2, k)]["restored"] == "0" for k in (1, 2))
    decay, _, rows = _run(tmp_path, "decay")  # stc's default
    assert rows[(2, lost)]["restored"] == "1"
    discard, _, rows = _run(tmp_path, "discard", unaggregated="discard")
    assert rows[(2, lost)]["restored"] == "0"
    update = torch.cat([keep[n] - discard[n] for n in keep])
    assert float(update.abs().sum()) > 0  # the lost update was something
    half = torch.cat([decay[n] - discard[n] for n in keep])
    torch.testing.assert_close(half, 0.5 * update, atol=1e-5, rtol=1e-4)
