"""downlink_context: catch-up patches whose grid tensors travel as segments of the ranking by
displacement from version 0 (fedgc.context_patch, server.downlink, the client's apply)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

import dgc
from android_bridge.bridge import BridgeError
from android_bridge.bridge_app import _as_values, _orders
from android_bridge.export import check_phone_run
from android_bridge.phone import PhoneError, ReferencePhone
from android_bridge.proto import fedgc_bridge_pb2 as pb
from client.app import ClientProtocolError, global_model
from client.state import ClientState
from dgc import SparseTensor, SparseUpdate
from dgc.int8_grid import round_initial
from fedgc import context_patch
from fedgc import protocol as P
from fedgc.patching import decode_patch, is_compact
from fedgc.settings import RunConfig, SettingsError
from server.downlink import Downlink


def _initial(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return OrderedDict([("w", torch.randn(100, 400, generator=g) * 0.05),
                        ("b", torch.zeros(100)),
                        ("v", torch.randn(10, 100, generator=g) * 0.05)])


def _run(context: bool, versions: int = 12,
         compact: bool = False) -> tuple[Downlink, list[dict[str, torch.Tensor]]]:
    """A downlink over ``versions`` versions whose model keeps moving the same entries (as
    training does: what moved before moves again), and the sent model at each version;
    ``compact``: its patches as compact messages (``downlink_compact``)."""
    d = Downlink("auto", 1000, 0.05, "int8", True, 1.0, "float16", context, compact)
    model = _initial()
    d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
    g = torch.Generator().manual_seed(1)
    busy = {k: torch.rand(v.shape, generator=g) < 0.1 for k, v in model.items()}
    sent = [{k: v.clone() for k, v in d.sent_model.items()}]
    for _ in range(versions):
        model = OrderedDict(
            (k, v + torch.where(busy[k], torch.randn(v.shape, generator=g) * 0.02,
                                torch.randn(v.shape, generator=g) * 0.0005))
            for k, v in model.items())
        d.advance(model, model)
        sent.append({k: v.clone() for k, v in d.sent_model.items()})
    return d, sent


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def test_a_ranked_patch_rebuilds_the_sent_model_bit_for_bit_on_every_base():
    d, sent = _run(True)
    plain, _ = _run(False)
    assert _same_bits(d.sent_model, plain.sent_model)  # the key changes bytes only
    ranked_bases = 0
    for base in range(d.version):  # one version behind to every version since 0
        patch = d.coded_patch((base,))
        assert patch is not None
        context = {n: d.origin[n] for n in patch.context}
        got = P.apply_patch(sent[base], patch.data, patch.added, context)
        assert _same_bits(got, sent[-1]), base
        assert len(patch.data) <= len(plain.patch((base,))[0])
        ranked_bases += bool(patch.context)
        if patch.context:  # the segments are ordinary tensors of the message
            names = set(dgc.decode(patch.data, max_numel=40000).tensors)
            assert any(n.startswith("w#") for n in names) and "w" not in names
    assert ranked_bases >= d.version // 2
    # the differences go without a code for zero (value dtype 66), which plain runs never send
    from dgc.wire.decoder import read_structure
    codings = {r.value_coding for r in read_structure(memoryview(d.coded_patch((2,)).data),
                                                      None)[1]}
    assert dgc.wire.GRID_NONZERO_CODED in codings
    plain_codings = {r.value_coding for base in range(plain.version)
                     for r in read_structure(memoryview(plain.patch((base,))[0]), None)[1]}
    assert dgc.wire.GRID_NONZERO_CODED not in plain_codings
    # a client several versions behind: clearly smaller than the plain patch
    assert len(d.coded_patch((2,)).data) < 0.9 * len(plain.patch((2,))[0])


def test_the_offer_counts_the_ranked_bytes_and_tells_the_client():
    d, _ = _run(True)
    offer = d.offers([(3,)])[(3,)]
    patch = d.coded_patch((3,))
    assert offer.kind == "patch" and offer.nbytes == len(patch.data) == len(
        P.record_to_bytes(offer.record, P.PATCH))
    cfg = d.config(offer, [0])
    assert cfg[P.PATCH_CONTEXT] == patch.context and patch.context
    # several bases (a client that may hold any of them) are never ranked: one base only
    assert d.coded_patch((2, 3)).context == []


def test_off_by_default_and_without_the_int8_grid():
    d = Downlink("auto", 10, 0.05, "int8", True, 1.0, "float16")
    d.reset(_initial())
    assert not d.context and d.origin == {} and "downlink_origin" not in d.state_dict()
    for values, deltas in (("float16", True), ("int8", False)):
        d = Downlink("auto", 10, 0.05, values, deltas, 0.5, "float32", True)
        d.reset(_initial())
        d.advance(_initial(1), _initial(1))
        assert d.origin == {} and d.coded_patch((0,)).context == []


def test_the_checkpoint_keeps_version_0_and_refuses_a_run_without_it():
    d, _ = _run(True, versions=5)
    state = d.state_dict()
    again = Downlink("auto", 1000, 0.05, "int8", True, 1.0, "float16", True)
    again.check_state(state)
    again.load_state_dict(state)
    assert again.coded_patch((2,)) == d.coded_patch((2,))
    plain, _ = _run(False, versions=5)
    from server.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="downlink_context"):
        again.check_state(plain.state_dict())


# ----------------------------------------------------------------- a hostile patch
def _segments_patch(d: Downlink, base: int) -> tuple[bytes, list[str], list[str]]:
    p = d.coded_patch((base,))
    assert p.context
    return p.data, p.added, p.context


def test_a_malformed_ranked_patch_is_refused_with_a_clear_error():
    d, sent = _run(True)
    data, added, ranked = _segments_patch(d, 4)
    context = {n: d.origin[n] for n in ranked}
    update = dgc.decode(data, max_numel=40000)
    seg = next(n for n in update.tensors if n.startswith("w#"))
    t = update.tensors[seg]
    # a segment of another size than the ranking's
    bad = dict(update.tensors)
    bad[seg] = SparseTensor(t.indices, t.values, (t.numel + 1,))
    with pytest.raises(P.ProtocolError, match=r"patch_context tensor 'w'.*holds"):
        P.apply_patch(sent[4], dgc.encode(SparseUpdate(bad), grid_coding=True), added, context)
    # a tensor sent both whole and as segments
    both = {**update.tensors, "w": SparseTensor(torch.tensor([0]), torch.tensor([0.5]),
                                                (100, 400))}
    with pytest.raises(P.ProtocolError, match="both whole and as patch_context"):
        P.apply_patch(sent[4], dgc.encode(SparseUpdate(both), grid_coding=True), added,
                      context)
    # a segment number beyond the ranking's, or segments of a tensor not named ranked
    for name in ("w#9", "w#01", "x#0"):
        extra = {**update.tensors, name: SparseTensor(torch.tensor([0]), torch.tensor([0.5]),
                                                      (4,))}
        with pytest.raises(P.ProtocolError, match="does not match the held model"):
            P.apply_patch(sent[4], dgc.encode(SparseUpdate(extra), grid_coding=True), added,
                          context)
    with pytest.raises(P.ProtocolError, match="names tensors the model lacks"):
        P.apply_patch(sent[4], data, added, {"nope": torch.zeros(3)})


def _message(data: bytes, config: dict) -> tuple[RecordDict, ConfigRecord]:
    content = RecordDict({P.ARRAYS: P.bytes_to_record(data, P.PATCH)})
    return content, ConfigRecord(config)


def test_the_client_applies_a_ranked_patch_and_refuses_bad_keys():
    d, sent = _run(True)
    base = 5
    offer = d.offers([(base,)])[(base,)]
    cfg = {**d.config(offer, []), P.MODEL_VERSION: d.version}
    held = ClientState(model={k: v.clone() for k, v in sent[base].items()}, model_version=base)
    initial = _initial  # the client builds version 0 from the seed, rounds it to the grid
    cfg[P.INITIAL_GRID] = True
    assert _same_bits(round_initial(initial()), {k: v for k, v in sent[0].items()})
    content, config = _message(P.record_to_bytes(offer.record, P.PATCH), cfg)
    assert _same_bits(global_model(content, config, held, initial), sent[-1])
    for key, value, match in ((P.PATCH_CONTEXT, "w", "must be a list"),
                              (P.PATCH_CONTEXT, ["zz"], "model lacks"),
                              (P.BASE_VERSIONS, [base, base - 1], "applies to one version")):
        bad = {**cfg, key: value}
        if key == P.BASE_VERSIONS:
            bad.pop(P.PATCH_ADD, None)
        content, config = _message(P.record_to_bytes(offer.record, P.PATCH), bad)
        with pytest.raises(ClientProtocolError, match=match):
            global_model(content, config, held, initial)
    content, config = _message(P.record_to_bytes(offer.record, P.PATCH), cfg)
    with pytest.raises(ClientProtocolError, match="cannot build version 0"):
        global_model(content, config, held, None)


def test_the_key_is_validated_and_phones_join_a_ranked_patch():
    """downlink_context on the phone path (issue 39): check_phone_run lets it through, and the
    reference phone joins a ranked patch, as the bridge hands it on (differences turned into
    the values they produce), on the model it holds and its version 0: the sent model bit for
    bit on every base; a context naming a tensor version 0 lacks is refused, named."""
    from android_bridge.phone import apply_context_patch

    with pytest.raises(SettingsError, match="downlink_context"):
        RunConfig.from_flat({"downlink_context": "maybe"})
    on = RunConfig.from_flat({"downlink_context": True})
    assert on.server.downlink_context and not RunConfig().server.downlink_context
    check_phone_run(on.method, on.server)
    d, sent = _run(True, versions=6)
    origin = {k: v.numpy() for k, v in d.origin.items()}
    ranked = 0
    for base in range(d.version):
        patch = d.coded_patch((base,))
        orders = _orders(sent[base], list(patch.context), d.origin)
        data = _as_values(patch.data, list(patch.added), sent[-1], orders)
        held = {k: v.numpy().copy() for k, v in sent[base].items()}
        got = apply_context_patch(held, data, list(patch.context), origin)
        assert _same_bits({k: torch.from_numpy(v) for k, v in got.items()}, sent[-1]), base
        assert _same_bits({k: torch.from_numpy(v) for k, v in held.items()}, sent[base])
        ranked += bool(patch.context)
    assert ranked >= d.version // 2
    patch = d.coded_patch((2,))
    assert patch.context
    with pytest.raises(P.ProtocolError, match="version 0 lacks"):
        apply_context_patch({k: v.numpy() for k, v in sent[2].items()}, patch.data,
                            list(patch.context), {})


def _phone_holding(model: dict[str, torch.Tensor], version: int,
                   version_0: dict[str, torch.Tensor]) -> ReferencePhone:
    """A reference phone (no export, no channel) that holds ``model`` at ``version`` and
    ranks against ``version_0``: enough for :meth:`ReferencePhone._global_model`."""
    phone = ReferencePhone.__new__(ReferencePhone)
    phone.shapes = {k: tuple(v.shape) for k, v in model.items()}
    phone.model = {k: v.numpy().copy() for k, v in model.items()}
    phone.model_version, phone.initial = version, None
    phone._ranked_from = ("v0", {k: v.numpy() for k, v in version_0.items()})
    return phone


def _patch_task(data: bytes, base: int, context: list[str]) -> pb.FetchTaskReply:
    return pb.FetchTaskReply(task_id="t", has_task=True, encoding=pb.SPARSE_PATCH,
                             base_version=base, model_bytes=data, patch_context=context,
                             initial_sha256="v0" if context else "")


def test_phones_read_compact_patches_as_simulated_clients_do():
    """downlink_compact on the phone path (issue 39): check_phone_run lets it through; the
    bridge's _as_values reads a compact patch (FGCK, on the model's layout and its ranked
    segments) and writes the values it produces in the same form, as apply_patch makes them;
    the reference phone applies it to the model it holds as a simulated client does
    (fedgc.patching.apply_patch with the differences added), bit for bit, on every base,
    ranked or not, in fewer bytes than the update message; a malformed one, or one read on
    another layout, is refused in one line, the held model unchanged."""
    run = RunConfig.from_flat({"method": "dgc_sets", "downlink_compact": True})
    assert run.server.downlink_compact and run.server.downlink_context
    check_phone_run(run.method, run.server)
    d, sent = _run(True, versions=6, compact=True)
    plain, _ = _run(True, versions=6)
    assert _same_bits(d.sent_model, plain.sent_model)
    ranked = 0
    for base in range(1, d.version):
        patch, other = d.coded_patch((base,)), plain.coded_patch((base,))
        context = list(patch.context)
        assert is_compact(patch.data) and patch.added and context == list(other.context)
        # the simulated client: differences added, segments joined
        want = P.apply_patch(sent[base], patch.data, patch.added,
                             {n: d.origin[n] for n in context})
        assert _same_bits(want, sent[-1]), base
        orders = _orders(sent[base], context, d.origin)
        data = _as_values(patch.data, list(patch.added), sent[-1], orders)
        values = _as_values(other.data, list(other.added), sent[-1], orders)
        assert is_compact(data) and not is_compact(values)
        assert len(data) < len(values), base
        # the values the compact patch carries are the update message's, tensor for tensor
        shapes = {k: tuple(v.shape) for k, v in sent[base].items()}
        got, ref = decode_patch(data, shapes, context), decode_patch(values, shapes, context)
        assert got.tensors.keys() == ref.tensors.keys()
        for name, t in ref.tensors.items():
            assert torch.equal(got.tensors[name].indices, t.indices), (base, name)
            assert torch.equal(got.tensors[name].values.view(torch.int32),
                               t.values.view(torch.int32)), (base, name)
        assert _same_bits(P.apply_patch(sent[base], data, (), {n: d.origin[n] for n in context}),
                          want)
        phone = _phone_holding(sent[base], base, d.origin)
        model = phone._global_model(_patch_task(data, base, context))
        assert _same_bits({k: torch.from_numpy(v) for k, v in model.items()}, want), base
        ranked += bool(context)
    assert ranked
    # refused, named, in one line; nothing held changes
    base = next(b for b in range(1, d.version) if d.coded_patch((b,)).context)
    patch = d.coded_patch((base,))
    context = list(patch.context)
    orders = _orders(sent[base], context, d.origin)
    data = _as_values(patch.data, list(patch.added), sent[-1], orders)
    broken = data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:]
    for bad, layout, match in ((broken, context, "bad checksum"),
                               (data, [], "layout digest"),
                               (data[:9], context, "truncated")):
        phone = _phone_holding(sent[base], base, d.origin)
        with pytest.raises(PhoneError, match=match) as ex:
            phone._global_model(_patch_task(bad, base, layout))
        assert "\n" not in str(ex.value) and str(ex.value).startswith("task 't': ")
        assert phone.model_version == base
        assert _same_bits({k: torch.from_numpy(v) for k, v in phone.model.items()}, sent[base])
        with pytest.raises(BridgeError, match=match) as ex:
            _as_values(bad, list(patch.added), sent[-1], orders if layout else None)
        assert "\n" not in str(ex.value)


def test_segments_split_and_join_back_on_any_ranking():
    g = torch.Generator().manual_seed(3)
    base, origin = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    order = context_patch.rank_order(base, origin)
    idx = torch.sort(torch.randperm(1000, generator=g)[:137]).values
    t = SparseTensor(idx, torch.randn(137, generator=g), (1000,))
    parts = context_patch.split("w", t, order)
    assert sum(p.nnz for p in parts.values()) == 137
    assert [p.shape[0] for p in parts.values()] <= [1000] * len(parts)
    back = context_patch.join("w", parts, order)
    assert torch.equal(back.indices, t.indices) and torch.equal(back.values, t.values)
    assert context_patch.cuts(1000) == [0, 20, 60, 150, 400, 1000]


# ----------------------------------------------------------------- a federation
def test_a_federation_with_ranked_patches_learns_the_same_model_in_fewer_bytes(tmp_path):
    """The same run with and without downlink_context: every round's accuracy and the final
    model are the same (the clients hold the same bits), the downlink is smaller, and no reply
    is rejected; the ranked run stops after 5 rounds and resumes from its checkpoint (which
    keeps version 0) to 8."""
    from simulations.api import run

    keys = {"task": "digits", "num_clients": 12, "clients_per_round": 3,
            "results_dir": str(tmp_path), "progress": False, "checkpoint": True}
    switches = {"sim__engine": "local", "downlink_deadband": 1.0,
                "downlink_vectors": "float16"}
    off = run(config={**keys, "rounds": 8, "run_name": "off"}, downlink_context=False,
              **switches)
    run(config={**keys, "rounds": 5, "run_name": "on"}, downlink_context=True, **switches)
    on = run(config={**keys, "rounds": 8, "run_name": "on", "resume": True},
             downlink_context=True, **switches)
    assert [r["accuracy"] for r in on.rounds] == [r["accuracy"] for r in off.rounds]
    a, b = torch.load(off.folder / "model.pt"), torch.load(on.folder / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert on.summary["clients_rejected"] == 0 and on.summary["clients_failed"] == 0
    assert on.summary["downlink_bytes"] < off.summary["downlink_bytes"]
    assert on.summary["uplink_bytes"] == off.summary["uplink_bytes"]
    assert on.summary["final_accuracy"] > 0.3
