"""dgc.ranking: entries ranked by displacement from version 0, as the stable sort ranks them,
built whole or moved along with the model; and where the server and the client use it
(server.downlink's kept rankings, the client's version 0 built once per process)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from client.app import initial_model, initial_model_of
from dgc.errors import StateError
from dgc.ranking import DisplacementOrder, ranked, top_positions
from fedgc import context_patch
from fedgc.settings import TaskSpec
from fedgc.task_loader import get_task
from server.downlink import RANKED_VERSIONS, Downlink


def _stable(model: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """The full rebuild the ranking must equal: a stable descending sort of the displacement."""
    return torch.sort((model.reshape(-1) - origin.reshape(-1)).abs(), descending=True,
                      stable=True).indices


def _grid_model(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor on a coarse grid and its version 0: many entries tie (unmoved ones at 0, moved
    ones on the same steps), and a -0.0 among them."""
    g = torch.Generator().manual_seed(seed)
    origin = torch.randint(-20, 20, (n,), generator=g).float() * 0.125
    model = origin + torch.randint(-3, 4, (n,), generator=g).float() * 0.125 \
        * (torch.rand(n, generator=g) < 0.3)
    model[0], origin[0] = -0.0, 0.0
    return model, origin


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_ranking_is_the_stable_sorts_ties_by_position(seed):
    model, origin = _grid_model(5000, seed)
    want = _stable(model, origin)
    assert torch.equal(ranked(model, origin), want)
    assert torch.equal(context_patch.rank_order(model.view(50, 100), origin.view(50, 100)), want)
    for k in (1, 37, 5000):
        assert torch.equal(top_positions(model, origin, k), want[:k])


def test_a_moved_ranking_equals_the_full_rebuild_version_after_version():
    model, origin = _grid_model(4000, 3)
    order = DisplacementOrder(model, origin)
    g = torch.Generator().manual_seed(4)
    for step in range(25):
        # a few entries, a quarter of them, all of them, none: any count merges back exactly
        m = [7, 1000, 4000, 0][step % 4]
        moved = torch.randperm(4000, generator=g)[:m]
        values = model[moved] + torch.randint(-2, 3, (m,), generator=g).float() * 0.125
        before = order.order.clone()
        nxt = order.moved(moved, values)
        assert torch.equal(order.order, before)  # the old ranking is left as it was
        model[moved] = values
        assert torch.equal(nxt.order, _stable(model, origin)), step
        order = nxt


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(StateError, match="4 entries ranked against version 0 of 5"):
        ranked(torch.zeros(4), torch.zeros(5))
    order = DisplacementOrder(torch.zeros(4), torch.zeros(4))
    with pytest.raises(StateError, match="outside a tensor of 4 entries"):
        order.moved(torch.tensor([4]), torch.tensor([1.0]))


def _downlink(versions: int) -> Downlink:
    d = Downlink("auto", 1000, 0.05, "int8", True, 0.5, "float16", True)
    g = torch.Generator().manual_seed(0)
    model = OrderedDict([("w", torch.randn(60, 300, generator=g) * 0.05),
                         ("b", torch.zeros(60))])
    d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
    busy = torch.rand(60, 300, generator=g) < 0.1
    for _ in range(versions):
        step = torch.where(busy, torch.randn(60, 300, generator=g) * 0.02,
                           torch.randn(60, 300, generator=g) * 0.0005)
        model = OrderedDict([("w", model["w"] + step), ("b", model["b"] + 0.001)])
        d.advance(model, model)
    return d


def test_the_servers_kept_rankings_are_the_full_rebuilds_and_code_the_same_patches():
    d = _downlink(RANKED_VERSIONS + 6)
    assert list(d.rankings) == list(range(7, d.version + 1))  # the last RANKED_VERSIONS
    for u in range(d.version + 1):
        base = d.grid_values_at(u)["w"]
        assert torch.equal(d.ranked("w", u, base), _stable(base, d.origin["w"])), u
    kept = {u: d.coded_patch((u,)) for u in range(d.version)}
    d.rankings.clear()  # every patch ranks its base whole
    for u, patch in kept.items():
        again = d.coded_patch((u,))
        assert patch.data == again.data and patch.context == again.context, u
    assert any(p.context for p in kept.values())


def test_a_resumed_downlink_ranks_again_from_its_checkpoint():
    d = _downlink(5)
    state = d.state_dict()
    resumed = Downlink("auto", 1000, 0.05, "int8", True, 0.5, "float16", True)
    resumed.load_state_dict(state)
    assert not resumed.rankings  # derived data: not in the checkpoint
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        model = OrderedDict((k, v + torch.randn(v.shape, generator=g) * 0.01)
                            for k, v in d.model.items())
        d.advance(model, model)
        resumed.advance(model, model)
    for u in (5, 6, 7, 8):
        assert d.coded_patch((u,)).data == resumed.coded_patch((u,)).data


def test_version_0_is_built_once_and_handed_out_as_copies():
    task = get_task("digits")
    spec = TaskSpec("digits", "", "", "", "")
    state = torch.random.get_rng_state()
    first = initial_model_of(spec, task, 3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the process's stream unmoved
    fresh = initial_model(task, 3)
    assert first.keys() == fresh.keys()
    assert all(torch.equal(first[k].view(torch.int32), fresh[k].view(torch.int32))
               for k in fresh)
    for t in first.values():
        t.add_(1.0)  # a caller's copy: the next caller still gets version 0
    again = initial_model_of(spec, task, 3)
    assert all(torch.equal(again[k], fresh[k]) for k in fresh)
    other = initial_model_of(spec, task, 4)
    assert not all(torch.equal(other[k], fresh[k]) for k in fresh)
