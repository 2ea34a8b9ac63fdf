"""A federation in which two of four clients are phones behind the bridge (TLS, loopback gRPC)."""

from __future__ import annotations

import csv
import dataclasses
import threading

import grpc
import numpy as np
import pytest
import torch

from android_bridge.bridge import PhoneBridge
from android_bridge.bridge_app import make_bridge_app
from android_bridge.phone import ReferencePhone
from client.app import app as client_app
from client.app import client_key

local_grid = pytest.importorskip("server.local_grid", reason="server.local_grid not on main yet")

from fedgc.settings import RunConfig  # noqa: E402
from server.app import run_server  # noqa: E402 - after the skip
from tests.test_bridge import BATCH, TOKENS, _certificates  # noqa: E402

torch.set_num_threads(1)

PHONES = {0: "phone-a", 1: "phone-b"}
SETTINGS = {"task": "digits", "num_clients": 4, "clients_per_round": 4, "partition": "iid",
            "density": 0.01, "dgc.warmup_rounds": 1, "progress": False, "local_steps": 4,
            "batch_size": BATCH, "lr": 0.1, "rounds": 3, "seed": 0,
            # What the phones were exported for (fedgc's defaults differ: see docs/android.md).
            "dgc.momentum_correction": True, "dgc.small_density": 0.0, "client_momentum": 0.0,
            # Plain FedAvg on the server: the test's 3 rounds must show progress, and server
            # momentum 0.5 (dgc runs' default) overshot within them here (0.198 -> 0.153).
            "server_momentum": 0.0}


def _phone_loop(phone: ReferencePhone, stop: threading.Event, reports: list, errors: list,
                cut_round: int | None) -> None:
    try:
        phone.register()
        while not stop.is_set():
            try:
                task = phone.wait_for_task(0.5)
            except TimeoutError:
                continue
            cut = 2048 if task.server_round == cut_round else None
            reports.append(phone.run_round(task, cut_after_bytes=cut))
    except Exception as ex:  # reported to the test thread
        errors.append(ex)


@pytest.fixture(scope="module")
def export(bridge_export):
    """The phones' export of the digits task (conftest's, shared by the session)."""
    return bridge_export


def _federation(tmp_path_factory, export, keys: dict, cut_after: int | None = None,
                intercept=None) -> tuple[RunConfig, dict, dict[str, list], list]:
    """Run ``SETTINGS`` with ``keys`` on a local grid whose phones (:data:`PHONES`, each a
    ReferencePhone behind one TLS bridge) train beside simulated clients: the run's config,
    its summary, each phone's reports and the phones' errors. ``cut_after``: phone-a's first
    upload is cut after that many chunks; ``intercept(grid, reply)``: the grid's reply hook."""
    from tasks import get_task

    ca, cert, key = _certificates(tmp_path_factory)
    task = get_task("digits")
    parts = task.partition(SETTINGS["num_clients"], scheme="iid", alpha=0.5, seed=0)
    config = RunConfig.from_flat({**SETTINGS, **keys,
                                  "results_dir": str(tmp_path_factory.mktemp("r"))})
    stop = threading.Event()
    reports: dict[str, list] = {d: [] for d in PHONES.values()}
    errors: list = []
    with PhoneBridge(TOKENS, "127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]),
                     max_chunk_bytes=1024) as bridge:
        phones, threads = [], []
        for pid, device in PHONES.items():
            idx = parts[pid]
            phone = ReferencePhone(export, device, TOKENS[device], f"localhost:{bridge.port}",
                                   task.train_x[idx].numpy(), task.train_y[idx].numpy(),
                                   root_certificates=ca)
            t = threading.Thread(target=_phone_loop, args=(
                phone, stop, reports[device], errors,
                cut_after if device == "phone-a" else None))
            t.start()
            phones.append(phone)
            threads.append(t)
        bridge_app = make_bridge_app(bridge, PHONES, timeout_s=60)

        def mixed(msg, context):
            app = bridge_app if client_key(context) in PHONES else client_app
            return app(msg, context)

        grid = local_grid.LocalGrid(mixed, SETTINGS["num_clients"], seed=1)
        if intercept is not None:
            grid.intercept = lambda reply: intercept(grid, reply)
        try:
            summary = run_server(grid, config)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            for p in phones:
                p.close()
    return config, summary, reports, errors


@pytest.mark.slow
def test_federation_with_phones_cut_upload_and_dropped_reply(tmp_path_factory, export):
    def drop_phone_b_in_round_1(grid, reply):
        if not reply.has_content() or reply.metadata.message_type != "train":
            return reply  # an error reply: the strategy counts it
        if grid.partition_of[reply.metadata.src_node_id] == 1 \
                and reply.metadata.group_id == "1":
            return None  # lost on the way back: never aggregated
        return reply

    config, summary, reports, errors = _federation(
        tmp_path_factory, export, {"run_name": "phones"}, cut_after=1,
        intercept=drop_phone_b_in_round_1)
    assert not errors, errors
    assert summary["rounds"] == 3
    a, b = reports["phone-a"], reports["phone-b"]
    assert [r.server_round for r in a] == [1, 2, 3] == [r.server_round for r in b]
    # Every task was a patch: the first on the version 0 each phone's export builds (the run's
    # seed is the export's), never the dense model.
    assert all(r.downlink == "patch" for r in a + b), [(r.downlink, r.downlink_bytes)
                                                       for r in a + b]
    # phone-a's round-1 upload (warm-up density 0.25, several KiB) was cut at 2 KiB and
    # resumed there.
    assert a[0].resume_offsets == [0, 2048] and a[0].uplink_bytes > 2048
    assert all(len(r.resume_offsets) == 1 for r in a[1:] + b)
    # phone-b's round-1 reply was dropped: in round 2 it folded that update back.
    assert [r.restored for r in b] == [False, True, False]
    assert not any(r.restored for r in a)
    rows = list(csv.DictReader((config.run_dir / "clients.csv").open()))
    up = {(int(r["round"]), int(r["client_key"])): int(r["uplink_bytes"]) for r in rows
          if r["status"] == "aggregated"}
    for rep in a:
        assert up[(rep.server_round, 0)] == rep.uplink_bytes
    assert (1, 1) not in up and up[(2, 1)] == b[1].uplink_bytes
    assert len(up) == 4 * 3 - 1  # every other client, phone or not, was aggregated every round
    accuracy = [float(r["accuracy"]) for r in csv.DictReader(
        (config.run_dir / "rounds.csv").open())]
    assert accuracy[-1] > accuracy[0]


@pytest.mark.parametrize("method", ["dense", "fedavgm", "stc"])
def test_methods_phones_do_not_run_are_refused_by_name(method):
    """A phone's exported encoder is DGC's: the bridge refuses the other methods, naming them."""
    from android_bridge.bridge import BridgeError
    from android_bridge.bridge_app import _phone_config

    run = RunConfig.from_flat({"method": method})
    with pytest.raises(BridgeError, match=rf"method '{method}' is not served by phones"):
        _phone_config(run.train, run.method)
    topk = RunConfig.from_flat({"method": "topk"})
    assert _phone_config(topk.train, topk.method)["train"]["method"] == "topk"


def test_dgc_switches_phones_do_not_run_fail_the_round_by_name():
    """Issue 30's dgc switches the phone does not run fail the round, named by the bridge
    app; those it runs on the host (issue 39: grid values at the sets and after the top-k)
    travel in the task's ``values`` entry."""
    from android_bridge.bridge import BridgeError
    from android_bridge.bridge_app import _phone_config
    run = RunConfig.from_flat({"dgc.step_ahead": 0.5})
    with pytest.raises(BridgeError, match=r"dgc.step_ahead=0.5: phones run dgc's default "):
        _phone_config(run.train, run.method)
    run = RunConfig.from_flat({"dgc.value_levels": 4, "dgc.shared_values": "grid",
                               "dgc.shared_first": True})
    assert _phone_config(run.train, run.method)["values"] == {"levels": 4.0,
                                                              "shared_levels": 1.0,
                                                              "first": 1.0}
    assert "values" not in _phone_config(RunConfig().train, RunConfig().method)


def test_a_host_encoder_task_names_its_payload_and_the_bridge_reads_it_with_its_codec():
    """randk's and efsign's phones compress on the host (android_bridge.host_encoders): the
    task names the payload (and randk's client seed), and the bridge reads an upload with the
    method's codec, bounded by the task's model; an upload of another kind, or a kind phones
    do not send, is named."""
    from android_bridge.bridge import PhoneTask, decode_update
    from android_bridge.bridge_app import _phone_config
    from android_bridge.host_encoders import SeededEncoder, host_encoder
    from dgc import DecodeError, SparseUpdate, encode
    from fedgc.methods.efsign import SignsCodec
    from fedgc.methods.randk import RandomKCodec, client_seed

    run = RunConfig.from_flat({"method": "randk", "seed": 5})
    config = _phone_config(run.train, run.method, client_key=3)
    assert config["codec"] == {"encoder": "randk", "payload": "seeded",
                               "seed": client_seed(run.train, 3)} \
        and client_seed(run.train, 3) == (5 << 32) + 3
    model = {"w": torch.zeros(30, 40), "b": torch.zeros(40)}
    task = PhoneTask("phone-a", 1, 1, 1, -1, encode(SparseUpdate.from_dense(model, "float32", 1)),
                     config)
    phone = SeededEncoder(config["codec"]["seed"])
    sent = phone.compress({n: np.ones(tuple(t.shape), np.float32) for n, t in model.items()},
                          run.method.phone_config(run.train), 0.0, 1)
    got = decode_update(task, RandomKCodec().encode(sent))
    assert got.seed == sent.seed and got.sequence == 1
    assert {n: t.indices.tolist() for n, t in got.tensors.items()} == \
        {n: t.indices.tolist() for n, t in sent.tensors.items()}
    with pytest.raises(DecodeError):  # the exported encoder's bytes where FGCR is due
        decode_update(task, encode(sent))
    big = SeededEncoder(1).compress({"w": np.ones((50, 50), np.float32)},
                                    run.method.phone_config(run.train), 0.0, 1)
    with pytest.raises(DecodeError, match="2500"):  # larger than the model's largest tensor
        decode_update(task, RandomKCodec().encode(big))
    odd = dataclasses.replace(task, config={**config, "codec": {"payload": "sketch"}})
    with pytest.raises(ValueError, match=r"phone payload 'sketch' is not one phones send; they "
                                         r"send \['levels', 'masked', 'seeded', 'signs'\]"):
        decode_update(odd, b"")
    # efsign's phones send the signs payload, read with its codec
    ef = RunConfig.from_flat({"method": "efsign"})
    signs = dataclasses.replace(task, config=_phone_config(ef.train, ef.method, client_key=3))
    assert signs.config["codec"] == {"encoder": "efsign", "payload": "signs"}
    sent = host_encoder(signs.config["codec"]).compress(
        {n: np.full(tuple(t.shape), -0.5, np.float32) for n, t in model.items()},
        ef.method.phone_config(ef.train), 0.0, 1)
    got = decode_update(signs, SignsCodec().encode(sent))
    assert {n: t.values.unique().tolist() for n, t in got.tensors.items()} == \
        {"w": [-0.5], "b": [-0.5]} and got.tensors["w"].nnz == 1200


def _qsgd_and_tcs_uploads() -> dict[str, tuple[object, bytes, object]]:
    """(task, the phone's upload, what it sent) for a qsgd and a tcs phone of one small model;
    tcs's task carries the round's mask (its ``shared_mask``)."""
    from android_bridge.bridge import PhoneTask
    from android_bridge.bridge_app import _phone_config
    from android_bridge.host_encoders import host_encoder
    from dgc import SparseUpdate, encode
    from dgc.signs.codec import encode_mask

    model = {"w": torch.zeros(30, 40), "b": torch.zeros(40)}
    dense = encode(SparseUpdate.from_dense(model, "float32", 1))
    grads = {n: np.random.default_rng(9).standard_normal(tuple(t.shape)).astype(np.float32)
             for n, t in model.items()}
    mask = {"w": np.arange(3, 1200, 100, dtype=np.int64)}
    out = {}
    for keys, shared in (({"method": "qsgd", "qsgd.bucket_size": 64}, None),
                         ({"method": "tcs", "density": 0.01, "dgc.min_sparse_numel": 100},
                          mask)):
        run = RunConfig.from_flat(keys)
        config = _phone_config(run.train, run.method, client_key=1)
        task = PhoneTask("phone-a", 2, 2, 2, -1, dense, config,
                         shared_mask=None if shared is None else
                         encode_mask(shared, {"w": 1200, "b": 40}, 2))
        phone = host_encoder(config["codec"])
        sent = phone.compress(grads, run.method.phone_config(run.train), 1.0, 2, shared)
        out[keys["method"]] = (task, phone.encode(sent), sent)
    return out


def test_the_bridge_reads_qsgd_and_tcs_uploads_against_the_tasks_mask():
    """qsgd's ``levels`` and tcs's ``masked`` uploads are read with their codecs; tcs's against
    the task's mask (values at it, no indices), with no room for a sign payload beside it."""
    from android_bridge.bridge import _Masks, decode_update
    from dgc import DecodeError
    from fedgc.methods.tcs import MaskedCodec, MaskedUpdate

    uploads = _qsgd_and_tcs_uploads()
    task, data, sent = uploads["qsgd"]
    got = decode_update(task, data)
    assert got.sequence == 2 and got.tensors["w"].values.tolist() == \
        sent.tensors["w"].values.tolist() and got.tensors["w"].nnz > 100
    task, data, sent = uploads["tcs"]
    assert _Masks(task).masks["w"].tolist() == list(range(3, 1200, 100))
    assert _Masks(task).max_bytes == 0  # the mask is answered in the payload, not by signs
    got = decode_update(task, data)
    assert got.sequence == 2 and got.tensors["b"].nnz == 40  # 1-D, small: whole
    assert (got.tensors["w"].nnz, sent.masked["w"].nnz) == (2, 12)  # 10% of the mask's 12
    # the mask's values left out: refused, naming the tensor
    bare = MaskedCodec().encode(MaskedUpdate(sent.tensors, 2))
    with pytest.raises(DecodeError, match=r"no values for \['w'\], masked this round"):
        decode_update(task, bare)
    with pytest.raises(DecodeError, match=r"values for 'w', which has no mask this round"):
        decode_update(dataclasses.replace(task, shared_mask=None), data)


def test_mutants_of_qsgd_and_tcs_uploads_are_refused_or_stay_in_bounds():
    """300 mutants of each upload (bench/reply_fuzz.py's: bit flips, truncations, huge floats,
    random bytes; the CRC made right again in most): the bridge refuses each with a
    DecodeError or ValueError (what it answers ``REJECTED`` with), or reads an update inside
    the task's model (indices in range, finite values, the task's sequence or another)."""
    from android_bridge.bridge import decode_update
    from bench.reply_fuzz import mutate
    from dgc import DecodeError

    rng = np.random.default_rng(39)
    for method, (task, data, _) in _qsgd_and_tcs_uploads().items():
        refused = 0
        for _ in range(300):
            kind, mutant = mutate(data, rng)
            try:
                update = decode_update(task, mutant)
            except (DecodeError, ValueError):
                refused += 1
                continue
            for name, t in update.tensors.items():
                assert t.numel <= 1200 and (t.nnz == 0 or 0 <= int(t.indices.min())
                                            and int(t.indices.max()) < t.numel), (method, kind)
                assert bool(torch.isfinite(t.values.float()).all()), (method, kind, name)
        assert refused > 150, (method, refused)


@pytest.mark.slow
def test_phones_behind_the_bridge_run_async(tmp_path_factory, export):
    """Issue 37: ``mode = async`` with two of four clients phones behind the bridge (TLS,
    loopback gRPC): each dispatch is a task of its own sequence, and the phones' updates are
    applied, staleness-weighted, with the others'."""
    config, summary, reports, errors = _federation(
        tmp_path_factory, export, {"mode": "async", "async.concurrency": 3,
                                   "async.buffer": 2, "rounds": 4, "run_name": "phones-async"})
    assert not errors, errors
    assert summary["rounds"] == 4
    rows = list(csv.DictReader((config.run_dir / "clients.csv").open()))
    assert all(r["status"] == "aggregated" for r in rows), rows
    tasks = [r for device in PHONES.values() for r in reports[device]]
    assert tasks, "no dispatch went to a phone"
    # Each phone's tasks are dispatches of increasing sequence, and each of its updates is a
    # row of the run, the bytes the phone sent.
    for device in PHONES.values():
        seqs = [r.server_round for r in reports[device]]
        assert seqs == sorted(set(seqs))
    sent = sorted(r.uplink_bytes for r in tasks)
    phone_rows = sorted(int(r["uplink_bytes"]) for r in rows if int(r["client_key"]) in PHONES)
    assert sent == phone_rows
    assert any(int(r["staleness"]) > 0 for r in rows)
