"""The bridge's control API: a SuperNode's ClientApp hands its train rounds to the serving bridge.

Flower 1.42 runs each message a SuperNode receives in a ClientApp process of its own, which ends
with the message (``flwr-clientapp``, started by the SuperNode's SuperExec). A phone's sessions,
its half-done uploads and the bridge's TLS port must outlive that, so they live in the process of
``python -m android_bridge serve`` (:class:`PhoneBridge`), and the ClientApp reaches it through
this service (``proto/fedgc_bridge_control.proto``) on a Unix socket in a folder only the
serving user can open. :func:`serve_control` runs the server half; :class:`RemoteBridge` is the
ClientApp's half, with :class:`PhoneBridge`'s ``submit`` and ``wait``, so that
``android_bridge.bridge_app.make_bridge_app`` drives either the same way.

A task travels as its fields: the scalars and the config as JSON, the byte fields (model,
patch, shared index sets) as bytes, so a field added to :class:`PhoneTask` travels without a
change here. The serving side rebuilds the task and checks it as the bridge does any task.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from android_bridge.bridge import (
    BridgeError,
    BridgeTimeout,
    PhoneBridge,
    PhoneResult,
    PhoneTask,
    decode_update,
)
from android_bridge.proto import fedgc_bridge_control_pb2 as cpb
from android_bridge.proto import fedgc_bridge_control_pb2_grpc as cpb_grpc

__all__ = ["RemoteBridge", "serve_control", "task_from_message", "task_to_message"]

#: A model, its patch and its index sets in one local message: far above any phone's model.
MAX_MESSAGE_BYTES = 1 << 30
# Time the ClientApp's call gets beyond the task's own wait (the answer's way back).
_GRACE_S = 30.0


def task_to_message(task: PhoneTask, timeout_s: float) -> cpb.ControlTask:
    """``task`` as a :class:`ControlTask` (its bytes apart, everything else as JSON)."""
    fields: dict[str, Any] = {}
    blobs: dict[str, bytes] = {}
    for f in dataclasses.fields(task):
        value = getattr(task, f.name)
        if isinstance(value, (bytes, bytearray)):
            blobs[f.name] = bytes(value)
        elif value is not None:
            fields[f.name] = value
    return cpb.ControlTask(fields_json=json.dumps(fields), blobs=blobs, timeout_s=timeout_s)


def task_from_message(message: cpb.ControlTask) -> PhoneTask:
    """The :class:`PhoneTask` of a :class:`ControlTask`; ValueError naming what is wrong."""
    try:
        fields = json.loads(message.fields_json)
    except ValueError as ex:
        raise ValueError(f"fields_json is not JSON: {ex}") from None
    if not isinstance(fields, dict):
        raise ValueError("fields_json must be a JSON object of PhoneTask fields")
    known = {f.name: f for f in dataclasses.fields(PhoneTask)}
    unknown = sorted((set(fields) | set(message.blobs)) - set(known))
    if unknown:
        raise ValueError(f"unknown PhoneTask fields {unknown}; known: {sorted(known)}")
    values = {**fields, **{k: bytes(v) for k, v in message.blobs.items()}}
    for name in ("device_id", "task_id", "base_sha256", "initial_sha256"):
        if name in values and not isinstance(values[name], str):
            raise ValueError(f"{name} must be a string, got {values[name]!r}")
    for name in ("server_round", "model_version", "sequence", "ack_sequence", "base_version"):
        if name in values and (isinstance(values[name], bool)
                               or not isinstance(values[name], int)):
            raise ValueError(f"{name} must be an integer, got {values[name]!r}")
    context = values.get("patch_context", [])
    if not isinstance(context, list) or not all(isinstance(n, str) for n in context):
        raise ValueError(f"patch_context must be a list of tensor names, got {context!r}")
    if not isinstance(values.get("config"), dict):
        raise ValueError("config must be a JSON object")
    missing = sorted(n for n, f in known.items() if n not in values
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"task lacks fields {missing}")
    return PhoneTask(**values)


class _Control(cpb_grpc.FedgcBridgeControlServicer):
    def __init__(self, bridge: PhoneBridge) -> None:
        self.bridge = bridge

    def RunTask(self, request: cpb.ControlTask,  # noqa: N802 - gRPC's method name
                context: grpc.ServicerContext) -> cpb.ControlResult:
        try:
            task = task_from_message(request)
        except (ValueError, TypeError) as ex:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad task: {ex}")
        if not 0 < request.timeout_s <= 86_400:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"timeout_s must be in (0, 86400], got {request.timeout_s}")
        if not self.bridge.knows(task.device_id):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"device {task.device_id!r} is not one of this bridge's devices")
        try:
            self.bridge.submit(task)
        except BridgeError as ex:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(ex))
        try:
            result = self.bridge.wait(task.task_id, request.timeout_s, alive=context.is_active)
        except BridgeTimeout as ex:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(ex))
        except BridgeError as ex:
            context.abort(grpc.StatusCode.CANCELLED, str(ex))
        return cpb.ControlResult(task_id=result.task_id, upload_id=result.upload_id,
                                 update_bytes=result.update_bytes, side_bytes=result.side_bytes,
                                 side_entries=result.side_entries,
                                 metrics_json=json.dumps(result.metrics))


def control_address(path: str | Path) -> str:
    """The gRPC address of the Unix socket ``path`` (absolute)."""
    return f"unix:{Path(path).resolve()}"


def serve_control(bridge: PhoneBridge, path: str | Path, max_workers: int = 64) -> grpc.Server:
    """Serve the control API for ``bridge`` on the Unix socket ``path`` and return the started
    server. The socket's folder must exist and be the serving user's alone (0700): whoever can
    open the socket can hand the phones tasks. ``max_workers``: calls served at once (one per
    phone node waiting on its phone)."""
    folder = Path(path).resolve().parent
    info = folder.stat()
    if info.st_mode & 0o077 or info.st_uid != os.getuid():
        raise BridgeError(f"the control socket's folder {folder} must be this user's alone "
                          f"(mode 0700), it is {oct(info.st_mode & 0o777)}")
    Path(path).unlink(missing_ok=True)  # a socket left by an earlier bridge
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    cpb_grpc.add_FedgcBridgeControlServicer_to_server(_Control(bridge), server)
    if server.add_insecure_port(control_address(path)) == 0:
        raise BridgeError(f"cannot listen on the control socket {path}")
    server.start()
    return server


class RemoteBridge:
    """The ClientApp's side: :class:`PhoneBridge`'s ``submit`` and ``wait``, served by the bridge
    of ``python -m android_bridge serve`` through its control socket.

    Parameters
    ----------
    address : str
        The control socket, ``unix:/path`` or a path (node config ``bridge-control``).
    """

    def __init__(self, address: str) -> None:
        self.address = address if address.startswith("unix:") else control_address(address)
        self._tasks: dict[str, PhoneTask] = {}

    def submit(self, task: PhoneTask) -> str:
        """Keep ``task`` for :meth:`wait` (the serving bridge gets it then)."""
        self._tasks[task.task_id] = task
        return task.task_id

    def wait(self, task_id: str, timeout_s: float) -> PhoneResult:
        """Hand the task to the serving bridge and wait for the phone's update.

        Raises
        ------
        BridgeTimeout
            The phone delivered nothing within ``timeout_s``.
        BridgeError
            The bridge refused the task or cannot be reached (the message says which).
        """
        task = self._tasks.pop(task_id)
        with grpc.insecure_channel(self.address, options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]) as channel:
            stub = cpb_grpc.FedgcBridgeControlStub(channel)
            try:
                reply = stub.RunTask(task_to_message(task, timeout_s),
                                     timeout=timeout_s + _GRACE_S)
            except grpc.RpcError as ex:
                code, detail = ex.code(), ex.details()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise BridgeTimeout(detail or f"no update from device {task.device_id!r} "
                                                  f"within {timeout_s} s") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise BridgeError(f"the phone bridge's control socket {self.address} does "
                                      f"not answer (is `python -m android_bridge serve` "
                                      f"running?): {detail}") from None
                raise BridgeError(f"the phone bridge refused task {task_id!r} of device "
                                  f"{task.device_id!r}: {code.name}: {detail}") from None
        update = decode_update(task, reply.update_bytes)
        metrics: Mapping[str, Any] = json.loads(reply.metrics_json or "{}")
        return PhoneResult(reply.task_id, reply.upload_id, reply.update_bytes, update,
                           dict(metrics), reply.side_bytes, int(reply.side_entries))
