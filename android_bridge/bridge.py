"""The phone-facing gRPC bridge: registration, task hand-out, resumable uploads, acknowledgements.

One :class:`PhoneBridge` runs a gRPC server (TLS when given credentials) for the phones and
offers the federation side two calls: :meth:`PhoneBridge.submit` hands a :class:`PhoneTask` to a
device, :meth:`PhoneBridge.wait` blocks until that device's encoded update has arrived whole,
with a valid digest and wire format, and returns it. Everything the phones send is checked
before it is stored; a refused request changes nothing that was stored before it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

import dgc
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from dgc.wire import max_numel_of_message

DEFAULT_MAX_CHUNK_BYTES = 64 * 1024
DEFAULT_MAX_UPDATE_BYTES = 64 * 1024 * 1024


class BridgeError(RuntimeError):
    """The federation side of the bridge cannot go on (unknown device, no upload in time)."""


class BridgeTimeout(BridgeError):
    """The phone did not deliver its update before the deadline."""


@dataclass
class PhoneTask:
    """One round of training handed to one phone.

    Parameters
    ----------
    device_id : str
        The phone that must run it.
    server_round, model_version, sequence, ack_sequence : int
        The round, the version of the model sent, the sequence the update must carry, and the
        sequence of this device's last aggregated update (-1 none).
    dense_model : bytes
        The whole model in the wire format (every tensor dense fp32).
    config : dict
        ``{"train": {...}, "dgc": DGCConfig.to_dict()}``, sent to the phone as JSON.
    patch : bytes or None
        A wire-format patch on ``base_version`` (values replace entries), sent instead of the
        dense model when the phone holds ``base_version``.
    base_version : int
        The version ``patch`` applies to (-1 when there is no patch).
    """

    device_id: str
    server_round: int
    model_version: int
    sequence: int
    ack_sequence: int
    dense_model: bytes
    config: dict[str, Any]
    patch: bytes | None = None
    base_version: int = -1
    task_id: str = field(default_factory=lambda: secrets.token_hex(8))


@dataclass
class PhoneResult:
    """A phone's delivered update: the encoded bytes (already validated) and its metrics."""

    task_id: str
    upload_id: str
    update_bytes: bytes
    update: dgc.SparseUpdate
    metrics: dict[str, Any]


@dataclass
class _Upload:
    upload_id: str
    device_id: str
    task_id: str
    total_bytes: int
    sha256: str
    metrics_json: str
    data: bytearray = field(default_factory=bytearray)
    state: int = pb.INCOMPLETE
    detail: str = ""


class PhoneBridge(pb_grpc.FedgcBridgeServicer):
    """The bridge between the federation and the phones (see the module docstring).

    Parameters
    ----------
    devices : mapping of str to str
        Device id -> its token. Only these devices may register.
    address : str
        Where to listen; port 0 picks a free port (see :attr:`port` after :meth:`start`).
    server_credentials : grpc.ServerCredentials or None
        TLS credentials (``grpc.ssl_server_credentials``); None listens in plaintext, which is
        only meant for tests on loopback.
    max_chunk_bytes : int
        Largest upload chunk accepted.
    max_update_bytes : int
        Largest encoded update accepted.
    poll_interval_s : float
        What Register tells phones to wait between polls for a task.
    """

    def __init__(self, devices: Mapping[str, str], address: str = "127.0.0.1:0",
                 server_credentials: grpc.ServerCredentials | None = None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
                 poll_interval_s: float = 0.05) -> None:
        for device_id, token in devices.items():
            if not device_id or not isinstance(token, str) or len(token) < 16:
                raise BridgeError(f"device {device_id!r} needs a token of at least 16 "
                                  f"characters")
        self._tokens = dict(devices)
        self.address = address
        self._credentials = server_credentials
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.max_update_bytes = int(max_update_bytes)
        self.poll_interval_s = float(poll_interval_s)
        self._lock = threading.Condition()
        self._sessions: dict[str, str] = {}
        self._open: dict[str, PhoneTask] = {}  # device -> its open task
        self._tasks: dict[str, PhoneTask] = {}  # task id -> task, open or done
        self._uploads: dict[str, _Upload] = {}
        self._results: dict[str, PhoneResult] = {}
        self._last_ack: dict[str, int] = {}
        self._server: grpc.Server | None = None
        self.port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> int:
        """Start serving; return the port."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_FedgcBridgeServicer_to_server(self, server)
        if self._credentials is None:
            port = server.add_insecure_port(self.address)
        else:
            port = server.add_secure_port(self.address, self._credentials)
        if port == 0:
            raise BridgeError(f"cannot listen on {self.address!r}")
        server.start()
        self._server, self.port = server, port
        return port

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving (in-flight calls get ``grace_s`` to finish)."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> PhoneBridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- federation side ------------------------------------------------------------------

    def submit(self, task: PhoneTask) -> str:
        """Hand ``task`` to its device; a device holds one open task at a time."""
        with self._lock:
            if task.device_id not in self._tokens:
                raise BridgeError(f"unknown device {task.device_id!r}; known: "
                                  f"{sorted(self._tokens)}")
            old = self._open.get(task.device_id)
            if old is not None:
                raise BridgeError(f"device {task.device_id!r} still has open task "
                                  f"{old.task_id!r} (round {old.server_round})")
            self._open[task.device_id] = task
            self._tasks[task.task_id] = task
            self._last_ack[task.device_id] = task.ack_sequence
            self._lock.notify_all()
        return task.task_id

    def wait(self, task_id: str, timeout_s: float) -> PhoneResult:
        """Block until the update for ``task_id`` is delivered; close the task either way."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if task_id not in self._tasks:
                raise BridgeError(f"unknown task {task_id!r}")
            while task_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._close(task_id)
                    raise BridgeTimeout(f"device {self._tasks[task_id].device_id!r} delivered "
                                        f"no update for task {task_id!r} within {timeout_s} s")
                self._lock.wait(left)
            self._close(task_id)
            return self._results.pop(task_id)

    def _close(self, task_id: str) -> None:
        task = self._tasks[task_id]
        if self._open.get(task.device_id) is task:
            del self._open[task.device_id]

    # -- phone side (gRPC) ----------------------------------------------------------------

    def _device(self, session_id: str, context: grpc.ServicerContext) -> str:
        device = self._sessions.get(session_id)
        if device is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"unknown session {session_id!r}: call Register first")
        return device

    def Register(self, request: pb.RegisterRequest,  # noqa: N802 - gRPC's method name
                 context: grpc.ServicerContext) -> pb.RegisterReply:
        """Open a session for a known device whose token matches."""
        token = self._tokens.get(request.device_id)
        if token is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"unknown device {request.device_id!r}: not registered with this "
                          f"bridge")
        if not hmac.compare_digest(token.encode(), request.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"wrong token for device {request.device_id!r}")
        session = secrets.token_hex(16)
        with self._lock:
            self._sessions[session] = request.device_id
        return pb.RegisterReply(session_id=session, poll_interval_s=self.poll_interval_s)

    def FetchTask(self, request: pb.FetchTaskRequest,  # noqa: N802
                  context: grpc.ServicerContext) -> pb.FetchTaskReply:
        """The device's open task (the same one until its update is delivered), if any."""
        with self._lock:
            device = self._device(request.session_id, context)
            task = self._open.get(device)
            if task is None or task.task_id in self._results:
                return pb.FetchTaskReply(has_task=False)
            use_patch = task.patch is not None and request.held_model_version == task.base_version
            return pb.FetchTaskReply(
                has_task=True, task_id=task.task_id, server_round=task.server_round,
                model_version=task.model_version,
                encoding=pb.SPARSE_PATCH if use_patch else pb.DENSE,
                base_version=task.base_version if use_patch else -1,
                model_bytes=task.patch if use_patch else task.dense_model,
                config_json=json.dumps(task.config, sort_keys=True),
                ack_sequence=task.ack_sequence, sequence=task.sequence,
                max_chunk_bytes=self.max_chunk_bytes)

    def UploadUpdate(self, request_iterator: Iterator[pb.UploadChunk],  # noqa: N802
                     context: grpc.ServicerContext) -> pb.UploadStatus:
        """Append chunks at the received offset; a cut stream keeps what arrived."""
        upload: _Upload | None = None
        for chunk in request_iterator:
            with self._lock:
                upload = self._accept_chunk(chunk, context)
        if upload is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload stream carried no chunk")
        return self._status(upload)

    def _accept_chunk(self, chunk: pb.UploadChunk, context: grpc.ServicerContext) -> _Upload:
        device = self._device(chunk.session_id, context)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        upload = self._uploads.get(chunk.upload_id)
        if upload is None:
            task = self._open.get(device)
            if task is None or task.task_id != chunk.task_id:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"task {chunk.task_id!r} is not open for device {device!r}")
            if not chunk.upload_id or len(chunk.upload_id) > 128:
                context.abort(bad, f"upload_id must be 1-128 characters, got "
                                   f"{chunk.upload_id!r}")
            if not 0 < chunk.total_bytes <= self.max_update_bytes:
                context.abort(bad, f"total_bytes must be in [1, {self.max_update_bytes}], got "
                                   f"{chunk.total_bytes}")
            if len(chunk.sha256) != 64 or any(c not in "0123456789abcdef" for c in chunk.sha256):
                context.abort(bad, f"sha256 must be 64 lowercase hex digits, got "
                                   f"{chunk.sha256!r}")
            upload = _Upload(chunk.upload_id, device, chunk.task_id, chunk.total_bytes,
                             chunk.sha256, chunk.metrics_json)
            self._uploads[chunk.upload_id] = upload
        if upload.device_id != device:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"upload {chunk.upload_id!r} belongs to another device")
        if (chunk.task_id, chunk.total_bytes, chunk.sha256) != (
                upload.task_id, upload.total_bytes, upload.sha256):
            context.abort(bad, f"chunk of upload {upload.upload_id!r} disagrees with its first "
                               f"chunk on task_id, total_bytes or sha256")
        if len(chunk.data) > self.max_chunk_bytes:
            context.abort(bad, f"chunk of {len(chunk.data)} bytes exceeds max_chunk_bytes "
                               f"{self.max_chunk_bytes}")
        received = len(upload.data)
        if upload.state != pb.INCOMPLETE:
            return upload  # a repeat after completion changes nothing
        if chunk.offset > received or chunk.offset < 0:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"chunk offset {chunk.offset} of upload {upload.upload_id!r}, "
                          f"expected {received} (ask QueryUpload)")
        # A resent chunk may overlap what already arrived: keep only the new tail.
        tail = chunk.data[received - chunk.offset:]
        if received + len(tail) > upload.total_bytes:
            context.abort(bad, f"upload {upload.upload_id!r} would exceed its total_bytes "
                               f"{upload.total_bytes}")
        upload.data += tail
        if len(upload.data) == upload.total_bytes:
            self._complete(upload)
        return upload

    def _complete(self, upload: _Upload) -> None:
        data = bytes(upload.data)
        task = self._tasks.get(upload.task_id)
        try:
            if hashlib.sha256(data).hexdigest() != upload.sha256:
                raise ValueError("sha256 of the received bytes does not match the declared one")
            update = dgc.decode(data, max_numel=max_numel_of_message(task.dense_model)
                                if task is not None else 0)
            if task is None or task.task_id in self._results:
                raise ValueError(f"task {upload.task_id!r} is no longer open")
            if update.sequence != task.sequence:
                raise ValueError(f"update carries sequence {update.sequence}, the task asked "
                                 f"for {task.sequence}")
            metrics = json.loads(upload.metrics_json or "{}")
            if not isinstance(metrics, dict):
                raise ValueError("metrics_json must be a JSON object")
        except (ValueError, dgc.DecodeError) as ex:
            upload.state, upload.detail = pb.REJECTED, str(ex)
            return
        upload.state, upload.detail = pb.DELIVERED, "handed to the federation"
        self._results[task.task_id] = PhoneResult(task.task_id, upload.upload_id, data, update,
                                                  metrics)
        self._lock.notify_all()

    def _status(self, upload: _Upload) -> pb.UploadStatus:
        return pb.UploadStatus(upload_id=upload.upload_id, received_bytes=len(upload.data),
                               total_bytes=upload.total_bytes,
                               complete=upload.state != pb.INCOMPLETE)

    def QueryUpload(self, request: pb.QueryUploadRequest,  # noqa: N802
                    context: grpc.ServicerContext) -> pb.UploadStatus:
        """How many bytes of an upload arrived (0 for an upload never seen)."""
        with self._lock:
            device = self._device(request.session_id, context)
            upload = self._uploads.get(request.upload_id)
            if upload is None:
                return pb.UploadStatus(upload_id=request.upload_id)
            if upload.device_id != device:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"upload {request.upload_id!r} belongs to another device")
            return self._status(upload)

    def Ack(self, request: pb.AckRequest,  # noqa: N802
            context: grpc.ServicerContext) -> pb.AckReply:
        """Whether an upload was delivered, and the device's last aggregated sequence."""
        with self._lock:
            device = self._device(request.session_id, context)
            upload = self._uploads.get(request.upload_id)
            if upload is None or upload.device_id != device:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"no upload {request.upload_id!r} from device {device!r}")
            return pb.AckReply(state=upload.state, detail=upload.detail,
                               last_aggregated_sequence=self._last_ack.get(device, -1))
