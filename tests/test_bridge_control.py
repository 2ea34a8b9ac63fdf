"""The bridge's control socket: a ClientApp process hands a round to the serving bridge's phone.

Flower runs each message in a ClientApp process of its own; the bridge (and the phones'
sessions) live in ``python -m android_bridge serve``. These tests run the control API as that
process serves it (a Unix socket in a private folder) against a real phone over TLS, and the
bridge app a phone's SuperNode runs (:func:`android_bridge.bridge_app.node_app`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import grpc
import pytest
import torch

import dgc
from android_bridge.bridge import BridgeError, BridgeTimeout, PhoneBridge
from android_bridge.control import (
    RemoteBridge,
    control_address,
    serve_control,
    task_from_message,
    task_to_message,
)
from android_bridge.proto import fedgc_bridge_control_pb2 as cpb
from android_bridge.proto import fedgc_bridge_control_pb2_grpc as cpb_grpc
from dgc.signs import decode_signs, encode_mask
from tests.test_bridge import TOKENS, _certificates, _phone, _task

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certificates(tmp_path_factory)


@pytest.fixture(scope="module")
def export_dir(bridge_export):
    return bridge_export


@pytest.fixture()
def served(certs, tmp_path):
    """A TLS bridge and its control socket, as `android_bridge serve` runs them."""
    ca, cert, key = certs
    folder = tmp_path / "control"
    folder.mkdir(mode=0o700)
    with PhoneBridge(TOKENS, "127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]),
                     max_chunk_bytes=1024) as bridge:
        server = serve_control(bridge, folder / "bridge.sock")
        try:
            yield bridge, folder / "bridge.sock"
        finally:
            server.stop(0).wait()


def _mask(state, sequence=1):
    """Shared index sets on the sparsified weight of the digits model (every 7th entry)."""
    name = "net.1.weight"
    numels = {name: state[name].numel()}
    return encode_mask({name: torch.arange(0, numels[name], 7).numpy()}, numels, sequence)


def test_a_round_through_the_control_socket_with_signs(served, certs, export_dir):
    bridge, sock = served
    phone = _phone(export_dir, bridge, certs)
    phone.register()
    task, state = _task("phone-a")
    task.shared_mask = _mask(state)
    remote = RemoteBridge(str(sock))
    thread = threading.Thread(target=lambda: phone.run_round(phone.wait_for_task(30)))
    thread.start()
    remote.submit(task)
    result = remote.wait(task.task_id, timeout_s=60)
    thread.join(60)
    phone.close()
    assert result.update_bytes == dgc.encode(phone.pending)
    # The phone answered the index sets: one sign per index, taken out of its residual.
    signs = decode_signs(result.side_bytes, {"net.1.weight": torch.arange(0, 12800, 7).numpy()},
                         {"net.1.weight": (12800,)})
    assert result.side_entries == signs.nnz == len(range(0, 12800, 7))
    assert torch.equal(signs.tensors["net.1.weight"].values,
                       phone.pending_signs.tensors["net.1.weight"].values)
    assert result.metrics["num-examples"] == 60 and bridge.stats()["open_tasks"] == 0


def test_control_refusals_are_named(served):
    bridge, sock = served
    remote = RemoteBridge(control_address(sock))
    unknown, _ = _task("phone-z")
    remote.submit(unknown)
    with pytest.raises(BridgeError, match="NOT_FOUND.*'phone-z' is not one of this bridge"):
        remote.wait(unknown.task_id, timeout_s=5)
    quiet, _ = _task("phone-b")
    remote.submit(quiet)
    with pytest.raises(BridgeTimeout, match="delivered no update"):
        remote.wait(quiet.task_id, timeout_s=0.5)
    bad, _ = _task("phone-b")
    bad.shared_mask = b"FGCM not a mask"
    remote.submit(bad)
    with pytest.raises(BridgeError, match="shared_mask.*is not a shared index set"):
        remote.wait(bad.task_id, timeout_s=5)
    gone = RemoteBridge(control_address(sock.parent / "nobody.sock"))
    gone.submit(_task("phone-a")[0])
    with pytest.raises(BridgeError, match="does not answer.*android_bridge serve"):
        gone.wait(next(iter(gone._tasks)), timeout_s=1)
    assert bridge.stats()["open_tasks"] == 0


def test_a_caller_that_goes_away_closes_its_task(served):
    """A ClientApp process that dies mid-round (Flower stopped the run) leaves no open task
    behind: the device takes the next round's task."""
    bridge, sock = served
    task, _ = _task("phone-a")
    with grpc.insecure_channel(control_address(sock)) as channel:
        stub = cpb_grpc.FedgcBridgeControlStub(channel)
        with pytest.raises(grpc.RpcError) as ex:
            stub.RunTask(task_to_message(task, 60), timeout=0.5)
    assert ex.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):
        if bridge.stats()["open_tasks"] == 0:
            break
        threading.Event().wait(0.1)
    assert bridge.stats() == {**bridge.stats(), "open_tasks": 0, "tasks": 0}
    again, _ = _task("phone-a")
    bridge.submit(again)  # no "still has open task"
    with pytest.raises(BridgeTimeout):
        bridge.wait(again.task_id, 0.1)


def test_task_messages_round_trip_and_bad_ones_are_named():
    task, _ = _task("phone-a")
    task.patch, task.base_version = b"patch", 3
    back = task_from_message(task_to_message(task, 10))
    assert back == task
    cases = [
        (cpb.ControlTask(fields_json="[1]"), "must be a JSON object"),
        (cpb.ControlTask(fields_json="{", blobs={}), "not JSON"),
        (cpb.ControlTask(fields_json=json.dumps({"evil": 1})), r"unknown PhoneTask fields"),
        (cpb.ControlTask(fields_json=json.dumps({"device_id": "a", "config": {}})),
         r"task lacks fields \['ack_sequence', 'dense_model'"),
        (cpb.ControlTask(fields_json=json.dumps({"device_id": 3, "config": {}})),
         "device_id must be a string"),
        (cpb.ControlTask(fields_json=json.dumps({"server_round": "1", "config": {}})),
         "server_round must be an integer"),
    ]
    for message, text in cases:
        with pytest.raises(ValueError, match=text):
            task_from_message(message)


def test_control_socket_folder_must_be_private(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o755)
    with PhoneBridge(TOKENS) as bridge, pytest.raises(BridgeError, match="mode 0700"):
        serve_control(bridge, folder / "bridge.sock")


def test_node_app_reads_its_node_config_and_keeps_held_models(tmp_path):
    from android_bridge.bridge_app import HeldModels, node_app
    from client.state import ClientState

    with pytest.raises(BridgeError, match="no 'bridge-control'"):
        node_app({"device-id": "phone-a"})
    with pytest.raises(BridgeError, match="bridge-timeout-s = 'soon'"):
        node_app({"device-id": "phone-a", "bridge-control": "unix:/x/s",
                  "bridge-timeout-s": "soon"})
    assert node_app({"device-id": "a", "bridge-control": "unix:/x/s"}) is node_app(
        {"device-id": "b", "bridge-control": "unix:/x/s"})  # one app per socket
    held = HeldModels(tmp_path / "held")
    assert held.get("phone-a") is None and len(held) == 0
    model = {"w": torch.arange(4.0)}
    held["phone-a"] = ClientState(model=model, model_version=3, pending=b"not kept")
    again = HeldModels(tmp_path / "held")["phone-a"]  # another process, the same store
    assert again.model_version == 3 and torch.equal(again.model["w"], model["w"])
    assert again.pending is None and list(again.model) == ["w"] and len(held) == 1


def test_a_round_of_many_phones_wakes_each_wait_only_for_its_own_task():
    """The federation waits on every phone's task at once (a RunTask per phone); opening the
    other phones' tasks must not wake a wait for one: with a thousand phones every event woke
    every wait (bench/bridge_load.py). ``alive`` is asked once per wake-up, so it counts them:
    300 tasks opened while one wait is held wake it at most once a second (its own check),
    where one condition for every wait woke it 300 times."""
    import time

    tokens = {f"phone-{i:03d}": f"token-{i:03d}-0123456789" for i in range(301)}
    bridge = PhoneBridge(tokens)  # submit and wait need no server
    task, _ = _task("phone-000")
    bridge.submit(task)
    wakes: list[float] = []
    done = threading.Event()

    def alive() -> bool:
        wakes.append(time.monotonic())
        return not done.is_set()

    waiter = threading.Thread(target=lambda: pytest.raises(
        BridgeError, bridge.wait, task.task_id, 60.0, alive=alive))
    waiter.start()
    while not wakes:  # the wait is held
        time.sleep(0.01)
    started = time.monotonic()
    for i in range(1, 301):
        bridge.submit(dataclasses.replace(task, device_id=f"phone-{i:03d}", task_id=f"t{i}"))
        time.sleep(0.001)  # tasks open one after another, as RunTask calls arrive
    during = [t for t in wakes if t >= started]
    elapsed = time.monotonic() - started
    done.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(during) <= 2 + int(elapsed), (len(during), elapsed)
