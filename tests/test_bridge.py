"""The phone bridge over loopback gRPC with TLS: auth, tasks, cut and resumed uploads."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import threading
import time

import grpc
import numpy as np
import pytest
import torch

import dgc
from android_bridge.bridge import (
    SESSION_METADATA_KEY,
    BridgeError,
    BridgeTimeout,
    PhoneBridge,
    PhoneTask,
)
from android_bridge.phone import ReferencePhone
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from android_bridge.runtime import PteEncoder
from dgc import DGCCompressor, DGCConfig, SparseUpdate

torch.set_num_threads(1)

TOKENS = {"phone-a": "a" * 16 + "-secret-a", "phone-b": "b" * 16 + "-secret-b"}
# What the federation's TrainSettings produce by default for method "dgc" (dgc.momentum 0).
EXPORT_CONFIG = DGCConfig(selection="exact", momentum=0.0, density=0.01, warmup_epochs=1)
BATCH = 10


def _certificates(tmp_path_factory):
    """A CA and a server certificate for localhost / 127.0.0.1, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedgc test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certificates(tmp_path_factory)


@pytest.fixture(scope="module")
def export_dir(bridge_export):
    return bridge_export


@pytest.fixture()
def bridge(certs):
    ca, cert, key = certs
    creds = grpc.ssl_server_credentials([(key, cert)])
    with PhoneBridge(TOKENS, "127.0.0.1:0", creds, max_chunk_bytes=1024) as b:
        yield b


def _channel(bridge, certs):
    return grpc.secure_channel(f"localhost:{bridge.port}",
                               grpc.ssl_channel_credentials(root_certificates=certs[0]))


def _data(n=60, seed=0):
    from tasks import get_task

    task = get_task("digits")
    idx = np.random.default_rng(seed).permutation(len(task.train_y))[:n]
    return task.train_x[idx].numpy(), task.train_y[idx].numpy()


def _task(device, server_round=1, ack=-1, seed=0):
    from tasks import get_task

    torch.manual_seed(seed)
    model = get_task("digits").build_model()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config = {"train": {"lr": 0.1, "batch_size": BATCH, "local_steps": 4, "local_epochs": 1,
                        "seed": 0, "method": "dgc"},
              "dgc": EXPORT_CONFIG.to_dict()}
    return PhoneTask(device_id=device, server_round=server_round, model_version=server_round - 1,
                     sequence=server_round, ack_sequence=ack,
                     dense_model=dgc.encode(SparseUpdate.from_dense(state, "float32")),
                     config=config), state


def _phone(export_dir, bridge, certs, device="phone-a", token=None):
    x, y = _data()
    return ReferencePhone(export_dir, device, token or TOKENS[device],
                          f"localhost:{bridge.port}", x, y, root_certificates=certs[0])


def test_unknown_device_wrong_token_and_bad_session_are_refused(bridge, certs):
    stub = pb_grpc.FedgcBridgeStub(_channel(bridge, certs))
    with pytest.raises(grpc.RpcError) as ex:
        stub.Register(pb.RegisterRequest(device_id="mallory", token="x" * 20))
    assert ex.value.code() == grpc.StatusCode.UNAUTHENTICATED
    unknown = ex.value.details()
    with pytest.raises(grpc.RpcError) as ex:
        stub.Register(pb.RegisterRequest(device_id="phone-a", token=TOKENS["phone-b"]))
    assert ex.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Answered alike: nothing tells a caller which device ids exist.
    assert ex.value.details() == unknown.replace("'mallory'", "'phone-a'")
    assert unknown == "device 'mallory' is unknown or its token is wrong"
    with pytest.raises(grpc.RpcError) as ex:
        stub.FetchTask(pb.FetchTaskRequest(session_id="forged"))
    assert ex.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown session 'forged'" in ex.value.details()
    session = stub.Register(pb.RegisterRequest(device_id="phone-a",
                                               token=TOKENS["phone-a"])).session_id
    assert not stub.FetchTask(pb.FetchTaskRequest(session_id=session)).has_task
    with pytest.raises(BridgeError, match="unknown device 'phone-z'"):
        bridge.submit(_task("phone-z")[0])


def test_plaintext_client_cannot_talk_to_the_tls_bridge(bridge):
    stub = pb_grpc.FedgcBridgeStub(grpc.insecure_channel(f"127.0.0.1:{bridge.port}"))
    with pytest.raises(grpc.RpcError) as ex:
        stub.Register(pb.RegisterRequest(device_id="phone-a", token=TOKENS["phone-a"]),
                      timeout=5)
    assert ex.value.code() == grpc.StatusCode.UNAVAILABLE


def test_phone_round_with_cut_and_resumed_upload(bridge, certs, export_dir):
    phone = _phone(export_dir, bridge, certs)
    phone.register()
    task, state = _task("phone-a")
    bridge.submit(task)
    reports = []
    fetched = phone.wait_for_task(10)
    assert fetched.encoding == pb.DENSE and fetched.max_chunk_bytes == 1024
    thread = threading.Thread(target=lambda: reports.append(
        phone.run_round(fetched, cut_after_bytes=3 * 1024)))
    thread.start()
    result = bridge.wait(task.task_id, timeout_s=60)
    thread.join(60)
    (report,) = reports
    # The first stream stopped at 3 KiB; the second resumed at the offset the bridge reported.
    assert report.resume_offsets[0] == 0 and report.resume_offsets[1] == 3 * 1024
    assert len(report.resume_offsets) == 2 and report.uplink_bytes > 3 * 1024
    assert report.ack_state == pb.DELIVERED
    assert hashlib.sha256(result.update_bytes).hexdigest() == hashlib.sha256(
        dgc.encode(phone.pending)).hexdigest()
    assert result.update.sequence == 1 and result.metrics["num-examples"] == 60
    # What arrived is what dgc computes from the phone's pseudo-gradient (recomputed here).
    local = phone.trainer.parameters()
    pseudo = {k: state[k] - torch.from_numpy(local[k]) for k in state}
    config = DGCConfig.from_dict(task.config["dgc"])
    want = DGCCompressor(config).compress(pseudo, epoch=0.0, sequence=1)
    got = dgc.decode(result.update_bytes, max_numel=dgc.wire.MAX_NUMEL)
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name].indices, t.indices), name
        assert torch.equal(got.tensors[name].values, t.values), name
    phone.close()


def test_bad_chunks_are_refused_and_change_nothing(bridge, certs):
    stub = pb_grpc.FedgcBridgeStub(_channel(bridge, certs))
    session = stub.Register(pb.RegisterRequest(device_id="phone-b",
                                               token=TOKENS["phone-b"])).session_id
    task, _ = _task("phone-b")
    bridge.submit(task)
    data = b"not a dgc update, but long enough to need three chunks" * 46
    assert 2048 < len(data) < 2924
    digest = hashlib.sha256(data).hexdigest()

    def chunk(offset, payload, **kw):
        fields = dict(session_id=session, task_id=task.task_id, upload_id="u1", offset=offset,
                      data=payload, total_bytes=len(data), sha256=digest,
                      metrics_json='{"num-examples": 60}')
        fields.update(kw)
        return pb.UploadChunk(**fields)

    meta = ((SESSION_METADATA_KEY, session),)

    assert stub.UploadUpdate(iter([chunk(0, data[:1000])]), metadata=meta).received_bytes == 1000
    cases = [
        (chunk(1500, data[1500:1600]), grpc.StatusCode.OUT_OF_RANGE, "expected 1000"),
        (chunk(1000, data[1000:2100]), grpc.StatusCode.INVALID_ARGUMENT,
         "exceeds max_chunk_bytes 1024"),
        (chunk(1000, data[1000:1100], total_bytes=5), grpc.StatusCode.INVALID_ARGUMENT,
         "disagrees with its first chunk"),
        (chunk(0, b"x", upload_id="u2", task_id="nope"), grpc.StatusCode.FAILED_PRECONDITION,
         "task 'nope' is not open"),
        (chunk(0, b"x", upload_id="u3", sha256="XYZ"), grpc.StatusCode.INVALID_ARGUMENT,
         "sha256 must be 64 lowercase hex digits"),
    ]
    for bad, code, text in cases:
        with pytest.raises(grpc.RpcError) as ex:
            stub.UploadUpdate(iter([bad]), metadata=meta)
        assert ex.value.code() == code and text in ex.value.details(), ex.value.details()
        status = stub.QueryUpload(pb.QueryUploadRequest(session_id=session, upload_id="u1"))
        assert status.received_bytes == 1000 and not status.complete
    # An overlapping resend keeps only the new tail; the whole upload completes, but it is not
    # a dgc update, so it is rejected with a reason and the federation gets nothing.
    status = stub.UploadUpdate(iter([chunk(900, data[900:1900]), chunk(1900, data[1900:])]),
                             metadata=meta)
    assert status.complete and status.received_bytes == len(data)
    ack = stub.Ack(pb.AckRequest(session_id=session, upload_id="u1"))
    assert ack.state == pb.REJECTED and "bad magic" in ack.detail, ack.detail
    with pytest.raises(BridgeTimeout, match="delivered no update"):
        bridge.wait(task.task_id, timeout_s=0.2)


def test_phone_refuses_config_its_export_cannot_run(bridge, certs, export_dir):
    phone = _phone(export_dir, bridge, certs, device="phone-b")
    phone.register()
    task, _ = _task("phone-b")
    task.config["dgc"]["nesterov"] = True
    bridge.submit(task)
    with pytest.raises(dgc.ConfigError, match="nesterov: exported False, requested True"):
        phone.run_round(phone.wait_for_task(10))
    # nothing was uploaded, and the phone's DGC state is untouched
    assert phone.pending is None and phone.encoder.step == 0
    assert isinstance(phone.encoder, PteEncoder)
    phone.close()


def test_bridge_turns_an_additive_patch_into_values_for_the_phone():
    """Phones apply patches whose values replace; the bridge app rewrites an int8 patch of
    differences (patch_add) into one, from the model it rebuilt: a phone applying it holds the
    server's version bit for bit, and the values stay grid-coded."""
    from android_bridge.bridge_app import _as_values
    from dgc.wire import GRID_CODED, GRID_RICE_CODED
    from tests.test_strategy import _apply_patch, _bits_equal, _int8_run
    from tests.test_wire import tensor_value_dtypes

    s, versions = _int8_run(4)
    rebuilt, added = _apply_patch(s, versions[2], (2,))  # what the bridge app computes
    assert added == ["fc1.weight", "fc2.weight"]
    data = _as_values(s.downlink.patch((2,))[0], added, rebuilt)
    phone = {k: v.clone() for k, v in versions[2].items()}
    # as ReferencePhone._global_model does
    for name, t in dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL).tensors.items():
        phone[name].view(-1)[t.indices] = t.values.float()
    assert _bits_equal(phone, versions[4])
    codings = tensor_value_dtypes(data)
    assert all(codings[n] in (GRID_CODED, GRID_RICE_CODED) for n in added)
    assert codings["fc1.bias"] == tensor_value_dtypes(s.downlink.patch((2,))[0])["fc1.bias"]


def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_long_poll_answers_with_the_task_and_sends_the_config_once(bridge, certs):
    """A FetchTask held for a task returns it as soon as it is submitted; a device holds one
    such call; a phone naming the config it holds is not sent it again."""
    stub = pb_grpc.FedgcBridgeStub(_channel(bridge, certs))
    reply = stub.Register(pb.RegisterRequest(device_id="phone-a", token=TOKENS["phone-a"]))
    assert reply.max_wait_s == bridge.max_wait_s > 0
    held = []
    thread = threading.Thread(target=lambda: held.append(stub.FetchTask(pb.FetchTaskRequest(
        session_id=reply.session_id, wait_s=30.0))))
    thread.start()
    _until(lambda: bridge.stats()["waiting"] == 1)
    # A second call of the same device while one is held is answered at once.
    assert not stub.FetchTask(pb.FetchTaskRequest(session_id=reply.session_id,
                                                  wait_s=30.0)).has_task
    task, _ = _task("phone-a")
    bridge.submit(task)
    thread.join(10)
    (first,) = held
    assert first.has_task and first.task_id == task.task_id
    assert first.config_sha256 == hashlib.sha256(first.config_json.encode()).hexdigest()
    again = stub.FetchTask(pb.FetchTaskRequest(session_id=reply.session_id,
                                               held_config_sha256=first.config_sha256))
    assert again.has_task and again.config_json == ""
    assert again.config_sha256 == first.config_sha256
    stale = stub.FetchTask(pb.FetchTaskRequest(session_id=reply.session_id,
                                               held_config_sha256="0" * 64))
    assert stale.config_json == first.config_json
    assert bridge.stats()["waiting"] == 0


def test_held_calls_are_bounded_over_all_devices(certs):
    ca, cert, key = certs
    with PhoneBridge(TOKENS, "127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]),
                     max_waiting=1) as b:
        stub = pb_grpc.FedgcBridgeStub(_channel(b, certs))
        sessions = {d: stub.Register(pb.RegisterRequest(device_id=d, token=TOKENS[d])).session_id
                    for d in TOKENS}
        held = threading.Thread(target=lambda: stub.FetchTask(pb.FetchTaskRequest(
            session_id=sessions["phone-a"], wait_s=30.0)))
        held.start()
        _until(lambda: b.stats()["waiting"] == 1)
        started = time.monotonic()
        # The bridge is full: phone-b's long poll is answered at once (it falls back to polls).
        assert not stub.FetchTask(pb.FetchTaskRequest(session_id=sessions["phone-b"],
                                                      wait_s=30.0)).has_task
        assert time.monotonic() - started < 20.0
    held.join(10)  # stopping the bridge answers the held call
    assert not held.is_alive()


def test_a_round_takes_one_fetch_and_one_stream(bridge, certs, export_dir):
    """Without a cut a phone's round is FetchTask and UploadUpdate: no QueryUpload before the
    first stream (a new upload has nothing stored), no Ack after a stream that said DELIVERED."""
    from simulations.wire.phone_process import CallLog

    phone = _phone(export_dir, bridge, certs)
    log = CallLog()
    phone.channel = grpc.intercept_channel(phone.channel, log)
    phone.stub = pb_grpc.FedgcBridgeStub(phone.channel)
    phone.register()
    task, _ = _task("phone-a")
    bridge.submit(task)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(
        phone.run_round(phone.wait_for_task(10))))
    thread.start()
    bridge.wait(task.task_id, timeout_s=60)
    thread.join(60)
    assert reports[0].ack_state == pb.DELIVERED
    assert [c["method"] for c in log.calls] == ["Register", "FetchTask", "UploadUpdate"]
    phone.close()


def test_a_first_task_is_a_patch_on_the_version_0_the_phones_export_builds(bridge, certs,
                                                                            export_dir):
    """The export names the version 0 train_step.pte bakes in (as built and on the int8 grid):
    that of a run with its seed, bit for bit. A phone that holds no model offers those digests
    and is sent a patch on the version 0 the bridge names, which it applies to its own; a phone
    that offers another digest, or none, gets the dense model."""
    import json

    from android_bridge.initial_model import model_digest
    from android_bridge.runtime import PteTrainer
    from client.app import initial_model
    from dgc.int8_grid import round_initial
    from tasks import get_task

    manifest = json.loads((export_dir / "manifest.json").read_text())["initial_model"]
    v0 = initial_model(get_task("digits"), 0)
    grid = round_initial(v0)
    assert manifest["sha256"] == model_digest(v0) == model_digest(
        PteTrainer(export_dir).parameters())
    assert manifest["int8_grid_sha256"] == model_digest(grid) != manifest["sha256"]
    # Version 1: a few entries of the grid version 0 changed; the patch carries only them.
    v1 = {k: v.clone() for k, v in grid.items()}
    v1["net.1.weight"].view(-1)[:5] = torch.arange(5, dtype=torch.float32)
    patch = dgc.encode(SparseUpdate({"net.1.weight": dgc.SparseTensor(
        torch.arange(5), torch.arange(5, dtype=torch.float32), tuple(v1["net.1.weight"].shape))},
        1))
    dense = dgc.encode(SparseUpdate.from_dense(v1, "float32"))
    task, _ = _task("phone-a", server_round=2)
    task.patch, task.base_version, task.base_sha256 = patch, 0, model_digest(grid)
    task.dense_model = dense
    bridge.submit(task)
    phone = _phone(export_dir, bridge, certs)
    phone.register()
    got = phone.wait_for_task(5.0)
    assert got.encoding == pb.SPARSE_PATCH and got.base_version == 0
    assert got.base_sha256 == manifest["int8_grid_sha256"] and len(got.model_bytes) < 100
    model = phone._global_model(got)
    assert all(np.array_equal(model[k], v1[k].numpy()) for k in v1)
    phone.close()
    # Another digest, or none: the dense model.
    stub = pb_grpc.FedgcBridgeStub(_channel(bridge, certs))
    session = stub.Register(pb.RegisterRequest(device_id="phone-a", token=TOKENS["phone-a"]))
    for held, offered in ((0, ["0" * 64]), (-1, [])):
        reply = stub.FetchTask(pb.FetchTaskRequest(session_id=session.session_id,
                                                   held_model_version=held,
                                                   initial_model_sha256=offered))
        assert reply.encoding == pb.DENSE and reply.model_bytes == dense and not reply.base_sha256


def test_a_phone_derives_ranked_sets_and_the_bridge_checks_its_signs(bridge, certs, export_dir):
    """dgc.shared_rank = displacement (issue 39): the task's shared_mask is a rank request and
    its shared_sets the sets it stands for; the phone derives them from the task's model and
    the version 0 its export builds (the form initial_sha256 names) and answers them with its
    residual's signs, which the bridge reads against those sets. A rank request without its
    sets or digest, or with sets of other sizes, is refused at submit; a phone whose export
    does not build the version 0 named refuses the task, naming it."""
    from android_bridge.initial_model import model_digest
    from android_bridge.phone import PhoneError
    from client.app import initial_model
    from dgc.signs import decode_signs, encode_mask
    from dgc.signs.codec import encode_rank_request
    from dgc.signs.planner import displacement_masks
    from tasks import get_task

    v0 = initial_model(get_task("digits"), 0)
    model = {k: v.clone() for k, v in v0.items()}
    g = torch.Generator().manual_seed(9)
    name = "net.1.weight"
    model[name].view(-1)[torch.randperm(model[name].numel(), generator=g)[:90]] += 0.05
    numels = {k: v.numel() for k, v in model.items()}
    counts = {name: 128}  # more than moved: ties (never moved) to the lower index
    masks = displacement_masks(model, v0, counts)
    task, _ = _task("phone-a", server_round=3)
    task.dense_model = dgc.encode(SparseUpdate.from_dense(model, "float32", 2))
    task.shared_mask = encode_rank_request(counts, numels, 3, False)
    refused = []
    for sets, digest in ((None, model_digest(v0)), (encode_mask(masks, numels, 0), ""),
                         (encode_mask({name: masks[name][:-1]}, numels, 0), model_digest(v0))):
        bad = PhoneTask(**{**task.__dict__, "task_id": f"bad-{len(refused)}",
                           "shared_sets": sets, "initial_sha256": digest})
        with pytest.raises(BridgeError, match="rank request|asks for") as ex:
            bridge.submit(bad)
        refused.append(str(ex.value))
    assert "have sizes {'net.1.weight': 127}, its rank request asks for" in refused[2]
    task.shared_sets, task.initial_sha256 = encode_mask(masks, numels, 0), model_digest(v0)
    phone = _phone(export_dir, bridge, certs)
    phone.register()
    bridge.submit(task)
    fetched = phone.wait_for_task(10)
    assert fetched.shared_mask == task.shared_mask and fetched.initial_sha256
    derived = phone._masks(fetched, {k: v.numpy() for k, v in model.items()})
    assert np.array_equal(derived[name], masks[name])
    thread = threading.Thread(target=lambda: phone.run_round(fetched))
    thread.start()
    result = bridge.wait(task.task_id, timeout_s=60)
    thread.join(60)
    signs = decode_signs(result.side_bytes, masks, {name: (numels[name],)})
    assert result.side_entries == signs.nnz == 128
    assert torch.equal(signs.tensors[name].values, phone.pending_signs.tensors[name].values)
    other = pb.FetchTaskReply()
    other.CopyFrom(fetched)
    other.initial_sha256 = "0" * 64
    phone._ranked_from = None
    with pytest.raises(PhoneError, match="version 0 000000000000, which this phone's export"):
        phone._masks(other, {k: v.numpy() for k, v in model.items()})
    phone.close()
