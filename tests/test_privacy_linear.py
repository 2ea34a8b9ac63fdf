"""Which methods sum under secure aggregation (fedgc/privacy/linear.py): each declared method's
payloads, through its own compressor and codec, masked and summed by SecAgg+, give the plain
combine's aggregate within the fixed point's bound; both ends compute one layout; per-client
coordinates are refused in one line; dgc_sets' and tcs' top-k go back to the residual."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from dgc import SparseUpdate
from fedgc.methods import Bound, get, material_of, registered
from fedgc.privacy import FixedPoint
from fedgc.privacy.linear import (
    NotLinearError,
    check_secure,
    client_compressor,
    hold_back,
    round_layout,
    secure_methods,
)
from fedgc.privacy.secagg.local import run_local
from fedgc.settings import RunConfig
from server.aggregation import Combine

SHAPES = {"w": (40, 50), "b": (50,), "out": (10, 30)}
LINEAR = ("dense", "fedavgm", "randk", "dgc_sets", "tcs", "fetchsgd")
ROUND = 3


def _config(method: str, **keys) -> RunConfig:
    return RunConfig.from_flat({"method": method, "dgc.min_sparse_numel": 100,
                                "dgc.small_numel": 500, "run_name": "t", **keys})


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) * 0.1 for n, s in SHAPES.items()}


def _round(name: str, clients: int = 4, **keys):
    """(method, config, the server's material, each client's material, the model the clients
    hold) for round ROUND of a run of ``name``."""
    config = _config(name, **keys)
    method = get(name).with_keys(config.own)
    part = material_of(method)
    channel = part.channel(config, SHAPES) if part is not None else None
    server, held = None, [None] * clients
    if name == "tcs":
        channel.observe(_grads(99))  # a first aggregate: the mask follows it
        _, server = channel.plan(ROUND)
        held = [server] * clients
    elif name == "dgc_sets":
        initial = {n: torch.zeros(s) for n, s in SHAPES.items()}
        channel.hold(initial, 0, False)
        model = {n: initial[n] + g for n, g in _grads(50).items()}
        channel.hold(model, 1, False)
        data, server = channel.plan(ROUND)
        numels = {n: math.prod(s) for n, s in SHAPES.items()}
        # Each client derives the sets from the model it holds (no index travels).
        held = [method.hold_material(data, method.read_material(data, numels), model,
                                     lambda: initial)[1] for _ in range(clients)]
    return method, config, server, held


def _payloads(method, config, server_material, client_materials, layout):
    """Each client's decoded payload as the server reads it, and how many entries it held
    back."""
    train, space = config.train, method.aggregator(config).space(SHAPES)
    codec, out, held_back = method.codec(train), [], 0
    for key, material in enumerate(client_materials):
        compressor = client_compressor(method, train, key, material)
        if compressor is None:
            update = SparseUpdate.from_dense(_grads(key), "float32", sequence=ROUND)
        else:
            update = compressor.compress(_grads(key), epoch=float(ROUND - 1), sequence=ROUND)
            if method.secure_sum == "material":
                update, held = hold_back(compressor, update, layout)
                held_back += held
        side = (method.side_part(compressor, material, ROUND)
                if compressor is not None and material is not None else None)
        bound = Bound(SHAPES, ROUND, server_material)
        payload = codec.decode(codec.encode(update), bound)
        codec.check(payload, bound)
        if side is not None:
            payload = payload.attach(method.read_side(side[0], server_material, SHAPES))
        out.append(payload)
    return out, held_back, space


@pytest.mark.parametrize("name", LINEAR)
def test_every_linear_method_sums_under_masks_as_the_plain_combine(name):
    method, config, server_material, client_materials = _round(name)
    space = method.aggregator(config).space(SHAPES)
    layout = round_layout(method, config.train, space, server_material, ROUND)
    # Each client computes the layout from its own material: the same coordinates.
    for m in client_materials:
        mine = round_layout(method, config.train, space, m, ROUND)
        assert [(s.name, None if s.indices is None else s.indices.tolist())
                for s in mine.segments] == [(s.name, None if s.indices is None
                                             else s.indices.tolist()) for s in layout.segments]
    payloads, _, space = _payloads(method, config, server_material, client_materials, layout)
    weights = [0.25, 0.5, 0.75, 1.0]  # each client scales its own vector: the server cannot
    fp = FixedPoint.for_clients(len(payloads), clip=4.0, value_bits=24)
    rng = np.random.default_rng(0)
    rings = {10 + i: fp.encode(w * layout.vector(p), rng)[0]
             for i, (w, p) in enumerate(zip(weights, payloads, strict=True))}
    run = run_local(rings, fp.modulus_bits, rng=random.Random(1))
    assert run.error is None
    secure = layout.combined(fp.decode_sum(run.total, len(rings)), sum(weights))
    plain = Combine("mean")(payloads, weights, [1.0] * len(payloads), space)
    bound = fp.error_bound(len(rings)) / sum(weights)
    for n in space:
        assert secure[n].shape == plain[n].shape
        assert float((secure[n] - plain[n]).abs().max()) <= bound + 1e-6
    # What is masked is the layout, not the model: the compressed methods stay small.
    d = sum(math.prod(s) for s in SHAPES.values())
    if name in ("randk", "dgc_sets", "tcs"):
        assert layout.length < 0.1 * d


def test_randk_needs_the_shared_seed_to_sum_under_masks():
    method, config, _, _ = _round("randk")
    train = config.train
    own = [method.compressor(train, key).compress(_grads(key), 2.0, ROUND) for key in (1, 2)]
    assert not torch.equal(own[0].tensors["w"].indices, own[1].tensors["w"].indices)
    shared = [client_compressor(method, train, key).compress(_grads(key), 2.0, ROUND)
              for key in (1, 2)]
    assert torch.equal(shared[0].tensors["w"].indices, shared[1].tensors["w"].indices)


def test_per_client_coordinates_are_refused_naming_the_methods_that_work():
    assert set(secure_methods()) == set(LINEAR)
    refused = [m for m in registered() if not m.secure_sum]
    assert {"dgc", "topk", "stc"} <= {m.name for m in refused}
    for method in refused:
        with pytest.raises(NotLinearError) as ex:
            check_secure(method, _config(method.name).train)
        message = str(ex.value)
        assert "\n" not in message and f"method {method.name!r}" in message
        assert all(name in message for name in LINEAR)
    with pytest.raises(NotLinearError, match="dgc.feedback = aggregate"):
        aggregate = _config("dgc_sets", **{"dgc.feedback": "aggregate"})
        check_secure(aggregate.method, aggregate.train)


def test_a_top_k_outside_the_sets_is_held_back_into_the_residual_or_refused():
    method, config, server_material, client_materials = _round("dgc_sets", clients=1)
    train = config.train
    layout = round_layout(method, train, SHAPES, server_material, ROUND)
    compressor = client_compressor(method, train, 0, client_materials[0])
    update = compressor.compress(_grads(0), epoch=float(ROUND - 1), sequence=ROUND)
    before = {n: t.clone() for n, t in compressor.residual().items()}
    top_k = {n: t for n, t in update.tensors.items() if n != "b"}  # "b" is sent whole
    assert all(t.nnz > 0 for t in top_k.values())
    kept, held = hold_back(compressor, update, layout)
    assert held == sum(t.nnz for t in top_k.values())
    assert all(kept.tensors[n].nnz == 0 for n in top_k) and kept.tensors["b"].nnz == 50
    after = compressor.residual()
    for n, t in top_k.items():
        gained = (after[n] - before[n])[t.indices]
        assert torch.allclose(gained, t.values.to(torch.float32))
    # Not held back, the top-k's indices cannot be summed: refused, naming the tensor.
    codec = method.codec(train)
    payload = codec.decode(codec.encode(update), Bound(SHAPES, ROUND, server_material))
    with pytest.raises(NotLinearError, match="outside the round's shared coordinates"):
        layout.vector(payload)
    # Central DP's projection (server.privacy.PrivateRound.layout_mean) does not refuse such a
    # reply for it: the entries off the layout are left out (the top-k is taken from a residual
    # whose sets were just sent: none of it is on the layout), those on it kept.
    held_back = codec.decode(codec.encode(kept), Bound(SHAPES, ROUND, server_material))
    projected = layout.vector(payload, strict=False)
    assert np.array_equal(projected, layout.vector(held_back)) and projected.any()


def test_under_secure_aggregation_dgc_sets_has_sets_from_the_first_round_and_they_move():
    """Its top-k held back, the model moves only at the sets: ranked by displacement alone
    they would be none in round 1 and the same ever after. ``dgc.shared_explore`` (0.25 by
    default under ``privacy.secagg``) draws a quarter of each set from the round's seed: round 1
    has sets, a client derives the server's from the request, and round 2 draws others."""
    numels = {n: math.prod(s) for n, s in SHAPES.items()}
    initial = {n: torch.zeros(s) for n, s in SHAPES.items()}
    plain = _config("dgc_sets")
    channel = material_of(get("dgc_sets").with_keys(plain.own)).channel(plain, SHAPES)
    channel.hold(initial, 0, False)
    assert channel.plan(1) is None  # without secure aggregation: as before
    config = _config("dgc_sets", **{"privacy.secagg": True})
    method = get("dgc_sets").with_keys(config.own)
    channel = material_of(method).channel(config, SHAPES)
    channel.hold(initial, 0, False)
    sets = []
    for server_round in (1, 2):
        data, server = channel.plan(server_round)
        _, client = method.hold_material(data, method.read_material(data, numels), initial,
                                         lambda: initial)
        assert server.keys() == client.keys() and server
        for name in server:
            assert server[name].tolist() == client[name].tolist()
        sets.append(server)
    assert any(sets[0][n].tolist() != sets[1][n].tolist() for n in sets[0])
    # the sets carry what the held-back top-k would have: dgc.secure_density (0.2) of a tensor
    assert len(sets[0]["w"]) == 400 and len(sets[0]["out"]) == 60
    explicit = _config("dgc_sets", **{"privacy.secagg": True, "dgc.shared_explore": 0.0})
    channel = material_of(get("dgc_sets").with_keys(explicit.own)).channel(explicit, SHAPES)
    channel.hold(initial, 0, False)
    assert channel.plan(1) is None  # the key set: displacement alone
