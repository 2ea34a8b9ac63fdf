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
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

import dgc
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from dgc.signs.codec import (
    RANK_MAGIC,
    Masks,
    decode_mask,
    decode_rank_request,
    decode_shared,
)
from dgc.wire import max_numel_of_message
from fedgc.methods import Bound, phone_codec_of

DEFAULT_MAX_CHUNK_BYTES = 64 * 1024
DEFAULT_MAX_UPDATE_BYTES = 64 * 1024 * 1024
#: Call metadata key that carries the session of an ``UploadUpdate`` stream: checked before the
#: bridge waits for a first chunk, so a stream without a session holds no worker thread.
SESSION_METADATA_KEY = "fedgc-session"
#: Largest ``metrics_json`` accepted: a few numbers need a few hundred bytes.
MAX_METRICS_BYTES = 4096
#: gRPC options for the phone's link, on both ends. BDP probing sends an HTTP/2 PING with a
#: stream's first data to size the flow-control window for bulk transfers; on a link that moves
#: a few kB a round it cost four PINGs and their ACKs, ~570 bytes a round, more than the rest
#: of gRPC's framing.
PHONE_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),)
# Worker threads kept free of upload streams, so Register, FetchTask, QueryUpload and Ack are
# answered however many streams are open.
_UNARY_WORKERS = 8


def update_cap_bytes(dense_model_bytes: int) -> int:
    """The largest encoded update worth accepting for a model whose dense form takes
    ``dense_model_bytes``: raw indices (4 bytes) with float32 values (4 bytes) at density 1,
    the costliest coding the wire format has, take twice the dense form; 4 KiB covers headers."""
    return 2 * int(dense_model_bytes) + 4096


#: The metrics a phone's ``metrics_json`` must (``num-examples``) or may carry that the
#: federation reads (``android_bridge.bridge_app``), with the reply checks of
#: ``server.replies``: an integer >= 1 (below 2^31), a finite number, an integer >= 0.
MAX_NUM_EXAMPLES = 2**31 - 1


def parse_metrics(text: str) -> dict[str, float | int | str | bool | None]:
    """A phone's ``metrics_json``: a flat JSON object of numbers, strings and booleans, whose
    ``num-examples`` is a whole number in [1, 2^31), ``train_loss`` (if sent) a finite number
    and ``restored`` (if sent) a whole number in [0, 2^31).

    Checked when the first chunk arrives, so that an upload whose metrics the federation
    could not use is refused before anything is stored, never acknowledged as delivered.

    Raises
    ------
    ValueError
        Over :data:`MAX_METRICS_BYTES`, not JSON (``NaN`` and ``Infinity`` are not JSON), not an
        object, nested, nested too deeply for the parser (named as such, not a
        ``RecursionError``), or one of the fields above out of its range.
    """
    size = len(text.encode())
    if size > MAX_METRICS_BYTES:
        raise ValueError(f"metrics_json of {size} bytes exceeds {MAX_METRICS_BYTES} bytes")
    try:
        metrics = json.loads(text or "{}", parse_constant=_not_json)
    except RecursionError:
        raise ValueError("metrics_json is nested too deeply; expected a flat JSON object of "
                         "numbers, strings and booleans") from None
    except ValueError as ex:
        raise ValueError(f"metrics_json is not JSON: {ex}") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics_json must be a JSON object, got {type(metrics).__name__}")
    for key, value in metrics.items():
        if value is not None and not isinstance(value, (int, float, str, bool)):
            raise ValueError(f"metrics_json value of {key!r} is a {type(value).__name__}; "
                             f"expected a number, string or boolean")
    _whole(metrics, "num-examples", 1, required=True)
    _whole(metrics, "restored", 0, required=False)
    loss = metrics.get("train_loss")
    if "train_loss" in metrics and (not _is_number(loss) or not math.isfinite(loss)):
        raise ValueError(f"metrics_json train_loss = {loss!r}; expected a finite number (leave "
                         f"it out when there is none)")
    return metrics


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(metrics: Mapping[str, Any], key: str, low: int, required: bool) -> None:
    """ValueError unless ``metrics[key]`` is a JSON integer in [low, 2^31) (or absent)."""
    if key not in metrics:
        if required:
            raise ValueError(f"metrics_json lacks {key!r}, a whole number >= {low}")
        return
    value = metrics[key]
    if not (isinstance(value, int) and not isinstance(value, bool)
            and low <= value <= MAX_NUM_EXAMPLES):
        raise ValueError(f"metrics_json {key} = {value!r}; expected a whole number in "
                         f"[{low}, {MAX_NUM_EXAMPLES}]")


def decode_update(task: PhoneTask, data: bytes, masks: _Masks | None = None) -> dgc.SparseUpdate:
    """A phone's update for ``task``: the exported encoder's ``FGCU`` bytes (``dgc.decode``),
    or the payload of the kind the task's ``codec`` names (random-k's ``seeded``, the
    ``signs`` of EF-signSGD and the vote, QSGD's ``levels``, TCS's ``masked``), read against
    the task's model by the method's codec, with the task's round material
    (``masks``, decoded from its ``shared_mask`` when not given: TCS's values at its mask); no
    tensor claims more entries than the task's model's largest. ``dgc.DecodeError`` or
    ValueError naming what is wrong."""
    limit = max_numel_of_message(task.dense_model)
    kind = (task.config.get("codec") or {}).get("payload")
    if kind is None:
        return dgc.decode(data, max_numel=limit)
    codec = phone_codec_of(str(kind))
    if masks is None:
        masks = _Masks(task)
    bound = Bound(masks.shapes, material=masks.masks if task.shared_mask else None,
                  limit=limit)
    # Decoded only: methods of one kind share a codec here (efsign's and the vote's signs);
    # the server checks the payload with its method's own. Values that are not finite (a
    # QSGD norm near float32's limit times its level) are refused here already.
    update = codec.decode(data, bound).update
    for name, t in update.tensors.items():
        if not bool(torch.isfinite(t.values).all()):
            raise ValueError(f"tensor {name!r} decodes to values that are not finite")
    return update


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
    shared_mask : bytes or None
        The round's shared index sets (``dgc.signs.codec.encode_mask``), or a rank request
        (``encode_rank_request``: per tensor only its set's size, ``dgc.shared_rank =
        displacement``) from which the phone derives them; the phone answers them with its
        residual's signs, appended to its update. None: no sign channel.
    shared_sets : bytes or None
        With a rank request in ``shared_mask``: the sets it stands for as an ``FGCM`` mask,
        derived by the federation side from the model it holds for the device (the phone
        derives the same and is not sent them); the bridge checks the phone's signs against
        them.
    initial_sha256 : str
        The digest of the version 0 a rank request or ``patch_context`` ranks against
        (:mod:`android_bridge.initial_model`): the form the phone must build from its export.
    patch_context : list of str
        Tensors of ``patch`` sent as segments of their entries ranked by displacement
        (``downlink_context``, :mod:`fedgc.context_patch`); the phone joins them on the ranking
        of the model it holds against version 0 (``initial_sha256``).
    base_sha256 : str
        For a patch on version 0 to a phone that was never sent a model: the digest of that
        version 0 (:mod:`android_bridge.initial_model`). The patch goes only to a phone that
        offers it among the versions 0 its export can build; any other gets the dense model.
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
    shared_mask: bytes | None = None
    base_sha256: str = ""
    shared_sets: bytes | None = None
    initial_sha256: str = ""
    patch_context: list[str] = field(default_factory=list)
    task_id: str = field(default_factory=lambda: secrets.token_hex(8))


@dataclass
class PhoneResult:
    """A phone's delivered update: the encoded bytes (already validated), its metrics, and the
    sign payload that answers the task's ``shared_mask`` (validated too; empty: none)."""

    task_id: str
    upload_id: str
    update_bytes: bytes
    update: dgc.SparseUpdate
    metrics: dict[str, Any]
    side_bytes: bytes = b""
    side_entries: int = 0


class _Masks:
    """A task's model shapes and round material (its ``shared_mask``), decoded once: the
    shared index sets a sign payload answers (``dgc``), or the mask a host encoder's payload
    answers itself (TCS, a task with a ``codec``: no sign payload then)."""

    def __init__(self, task: PhoneTask) -> None:
        model = dgc.decode(task.dense_model, max_numel=max_numel_of_message(task.dense_model))
        self.shapes = {name: tuple(t.shape) for name, t in model.tensors.items()}
        self.numels = {name: t.numel for name, t in model.tensors.items()}
        self.masks: Masks = {}
        try:
            if task.shared_mask and bytes(task.shared_mask[:4]) == RANK_MAGIC:
                self.masks = self._ranked(task)
            elif task.shared_mask:
                _, self.masks = decode_mask(task.shared_mask, self.numels)
        except dgc.DecodeError as ex:
            raise BridgeError(f"the shared_mask of task {task.task_id!r} is not a shared "
                              f"index set of its model (phones answer only dgc.signs masks and "
                              f"rank requests): {ex}") from ex
        # The largest sign payload: a header per tensor, a scale and a bit per index; with
        # grid values (dgc.shared_values = grid) at most a float32 a value; none where the
        # payload itself answers the mask.
        signs = not task.config.get("codec")
        per_entry = 32 if float((task.config.get("values") or {}).get("shared_levels", 0.0)) \
            > 0 else 1
        self.max_bytes = 64 + sum(80 + len(n.encode()) + (len(m) * per_entry + 7) // 8
                                  for n, m in self.masks.items()) if signs else 0

    def _ranked(self, task: PhoneTask) -> Masks:
        """The sets a rank request stands for: the task's ``shared_sets``, which must hold a
        set of the requested size per tensor requested, and the digest of the version 0 the
        phone ranks against."""
        _, counts, _, _ = decode_rank_request(task.shared_mask, self.numels)
        if not task.shared_sets or not task.initial_sha256:
            raise BridgeError(f"task {task.task_id!r} sends a rank request without the sets it "
                              f"stands for (shared_sets) and its version 0 (initial_sha256)")
        _, masks = decode_mask(task.shared_sets, self.numels)
        sizes = {n: len(m) for n, m in masks.items()}
        if sizes != counts:
            raise BridgeError(f"the shared_sets of task {task.task_id!r} have sizes {sizes}, "
                              f"its rank request asks for {counts}")
        return masks

    def check(self, side: bytes) -> int:
        """The number of signs (or grid values) ``side`` carries; ValueError or DecodeError
        when it does not answer these sets."""
        shared = decode_shared(side, self.masks, {n: (self.numels[n],) for n in self.masks})
        return shared.nnz


@dataclass
class _Upload:
    upload_id: str
    device_id: str
    task_id: str
    total_bytes: int
    sha256: str
    metrics: dict[str, Any]
    side_bytes: int = 0
    data: bytearray = field(default_factory=bytearray)
    received: int = 0  # kept when ``data`` is freed at the end
    state: int = pb.INCOMPLETE
    detail: str = ""

    def finish(self, state: int, detail: str) -> None:
        """Enter a final state and free the bytes (a result holds its own copy)."""
        self.state, self.detail = state, detail
        self.data = bytearray()


@dataclass
class _Stream:
    device_id: str
    context: grpc.ServicerContext
    last_seen: float
    expired: bool = False


class PhoneBridge(pb_grpc.FedgcBridgeServicer):
    """The bridge between the federation and the phones (see the module docstring).

    What one phone can hold is bounded (docs/threat_model.md has the numbers): its sessions,
    its upload streams and how long they may idle, its partial uploads and their bytes (sized
    from the model of its task). What is done is pruned: a task when its wait ends, its partial
    uploads with it, and all but the last few finished uploads of a device (kept for Ack).

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
        Largest encoded update accepted whatever the model; a task's own cap is the smaller of
        this and :func:`update_cap_bytes` of its dense model.
    poll_interval_s : float
        What Register tells phones to wait between polls for a task when they do not
        long-poll (or the bridge could not hold their call).
    max_wait_s : float
        The longest a FetchTask may be held for a task (long poll; 0 turns it off). A phone
        that waits 60 s per call costs one request a minute while idle instead of one per
        ``poll_interval_s``, and hears of its task at once; a phone that vanished is noticed no
        later than before (by its round's wait, ``PhoneBridge.wait``).
    max_waiting : int
        FetchTask calls held at once over all devices (one per device); beyond, a call is
        answered at once and the phone polls. The gRPC server gets this many more workers.
    max_streams : int
        Upload streams open at once over all devices (RESOURCE_EXHAUSTED beyond). The gRPC
        server gets this many worker threads plus 8 that streams never take.
    max_streams_per_device : int
        Upload streams one device may hold at once.
    stream_idle_timeout_s : float
        A stream that delivers no chunk for this long is cancelled (its bytes are kept).
    max_partial_uploads_per_device : int
        Incomplete uploads one device may hold at once.
    max_sessions_per_device : int
        Sessions one device may hold; registering once more ends its oldest.
    finished_uploads_kept : int
        Finished uploads (their state, not their bytes) kept per device for Ack.
    """

    def __init__(self, devices: Mapping[str, str], address: str = "127.0.0.1:0",
                 server_credentials: grpc.ServerCredentials | None = None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
                 poll_interval_s: float = 0.05, max_wait_s: float = 60.0,
                 max_waiting: int = 64, max_streams: int = 16,
                 max_streams_per_device: int = 2, stream_idle_timeout_s: float = 30.0,
                 max_partial_uploads_per_device: int = 2, max_sessions_per_device: int = 4,
                 finished_uploads_kept: int = 8) -> None:
        for device_id, token in devices.items():
            if not device_id or not isinstance(token, str) or len(token) < 16:
                raise BridgeError(f"device {device_id!r} needs a token of at least 16 "
                                  f"characters")
        if not (isinstance(max_wait_s, (int, float)) and 0.0 <= max_wait_s <= 3600.0):
            raise BridgeError(f"max_wait_s={max_wait_s!r}, expected seconds in [0, 3600]")
        for name, value in (("max_chunk_bytes", max_chunk_bytes),
                            ("max_waiting", max_waiting),
                            ("max_update_bytes", max_update_bytes), ("max_streams", max_streams),
                            ("max_streams_per_device", max_streams_per_device),
                            ("max_partial_uploads_per_device", max_partial_uploads_per_device),
                            ("max_sessions_per_device", max_sessions_per_device),
                            ("finished_uploads_kept", finished_uploads_kept)):
            if not isinstance(value, int) or value < 1:
                raise BridgeError(f"{name}={value!r}, expected an integer >= 1")
        if not stream_idle_timeout_s > 0:
            raise BridgeError(f"stream_idle_timeout_s={stream_idle_timeout_s!r}, expected > 0")
        self._tokens = dict(devices)
        self.address = address
        self._credentials = server_credentials
        self.max_chunk_bytes = max_chunk_bytes
        self.max_update_bytes = max_update_bytes
        self.poll_interval_s = float(poll_interval_s)
        self.max_wait_s = float(max_wait_s)
        self.max_waiting = max_waiting
        self._waiting: dict[str, int] = {}  # device -> FetchTask calls held for it
        self.max_streams = max_streams
        self.max_streams_per_device = max_streams_per_device
        self.stream_idle_timeout_s = float(stream_idle_timeout_s)
        self.max_partial_uploads_per_device = max_partial_uploads_per_device
        self.max_sessions_per_device = max_sessions_per_device
        self.finished_uploads_kept = finished_uploads_kept
        # One lock for all the state; the waits wake on conditions of their own (a task's
        # result, a device's task), so that an event wakes only who waits for it: with a
        # thousand phones a condition shared by every wait made each event wake them all.
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._task_done: dict[str, threading.Condition] = {}  # task id -> its result's
        self._device_wake: dict[str, threading.Condition] = {}  # device -> its held fetch's
        self._sessions: dict[str, str] = {}  # session -> device
        self._device_sessions: dict[str, list[str]] = {}  # device -> its sessions, oldest first
        self._open: dict[str, PhoneTask] = {}  # device -> its open task
        self._tasks: dict[str, PhoneTask] = {}  # task id -> task, until its wait ends
        # device -> upload id -> upload, oldest first: one device cannot see, or tell apart,
        # another's ids, and what one device holds is found without looking at the others'.
        self._uploads: dict[str, dict[str, _Upload]] = {}
        self._results: dict[str, PhoneResult] = {}
        self._masks: dict[str, _Masks] = {}  # task id -> its shared index sets
        self._last_ack: dict[str, int] = {}
        self._streams: dict[int, _Stream] = {}
        self._next_stream = 0
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self.port: int | None = None
        # A token for unknown devices, so both refusals take the same comparison.
        self._decoy = secrets.token_hex(16).encode()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> int:
        """Start serving; return the port."""
        # Room for every metadata field of a chunk besides its data (sha256, ids, metrics).
        max_message = self.max_chunk_bytes + MAX_METRICS_BYTES + 4096
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.max_streams + self.max_waiting + _UNARY_WORKERS),
            options=[("grpc.max_receive_message_length", max_message), *PHONE_CHANNEL_OPTIONS])
        pb_grpc.add_FedgcBridgeServicer_to_server(self, server)
        if self._credentials is None:
            port = server.add_insecure_port(self.address)
        else:
            port = server.add_secure_port(self.address, self._credentials)
        if port == 0:
            raise BridgeError(f"cannot listen on {self.address!r}")
        server.start()
        self._server, self.port = server, port
        self._stopping.clear()
        self._watchdog = threading.Thread(target=self._watch_streams, daemon=True,
                                          name="bridge-stream-watchdog")
        self._watchdog.start()
        return port

    def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving (in-flight calls get ``grace_s`` to finish)."""
        self._stopping.set()
        with self._lock:
            for wake in self._device_wake.values():
                wake.notify_all()  # held FetchTask calls answer now
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._watchdog is not None:
            self._watchdog.join(5.0)
            self._watchdog = None

    def __enter__(self) -> PhoneBridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        """What the bridge holds now: sessions, open tasks, tasks awaited, uploads, bytes of
        partial uploads, undelivered results, open upload streams and held FetchTask calls."""
        with self._lock:
            return {"sessions": len(self._sessions), "open_tasks": len(self._open),
                    "tasks": len(self._tasks),
                    "uploads": sum(len(u) for u in self._uploads.values()),
                    "upload_bytes": sum(len(u.data) for ups in self._uploads.values()
                                        for u in ups.values()),
                    "results": len(self._results), "streams": len(self._streams),
                    "waiting": sum(self._waiting.values())}

    # -- federation side ------------------------------------------------------------------

    def knows(self, device_id: str) -> bool:
        """Whether ``device_id`` is one of the devices that may register."""
        return device_id in self._tokens

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
            if task.shared_mask:
                self._masks[task.task_id] = _Masks(task)
            self._open[task.device_id] = task
            self._tasks[task.task_id] = task
            self._task_done[task.task_id] = threading.Condition(self._mutex)
            self._last_ack[task.device_id] = task.ack_sequence
            self._wake(task.device_id)
        return task.task_id

    def wait(self, task_id: str, timeout_s: float,
             alive: Callable[[], bool] | None = None) -> PhoneResult:
        """Block until the update for ``task_id`` is delivered; close the task either way.

        An upload that completes after this returns (or raises) is not delivered: its phone
        reads ``MISSED_ROUND``. ``alive`` (checked every second) tells whether whoever waits
        still does: when it returns False the task is closed and :class:`BridgeError` raised
        (the control API's caller, a ClientApp process, went away).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if task_id not in self._tasks:
                raise BridgeError(f"unknown task {task_id!r} (never submitted, or already "
                                  f"waited for)")
            device = self._tasks[task_id].device_id
            while task_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._close(task_id)
                    raise BridgeTimeout(f"device {device!r} delivered no update for task "
                                        f"{task_id!r} within {timeout_s} s")
                if alive is not None and not alive():
                    self._close(task_id)
                    raise BridgeError(f"the federation stopped waiting for task {task_id!r} "
                                      f"of device {device!r}")
                self._task_done[task_id].wait(left if alive is None else min(left, 1.0))
            self._close(task_id)
            return self._results.pop(task_id)

    def _close(self, task_id: str) -> None:
        """Forget a task whose wait ended; its partial uploads can no longer count."""
        task = self._tasks.pop(task_id)
        self._task_done.pop(task_id, None)
        self._masks.pop(task_id, None)
        if self._open.get(task.device_id) is task:
            del self._open[task.device_id]
        for upload in self._device_uploads(task.device_id):
            if upload.task_id == task_id and upload.state == pb.INCOMPLETE:
                upload.finish(pb.MISSED_ROUND,
                              f"round {task.server_round} stopped waiting after "
                              f"{upload.received} of {upload.total_bytes} bytes; the update "
                              f"was not aggregated (restore it: the next ack_sequence will "
                              f"not name it)")
        self._prune_uploads(task.device_id)

    def _device_uploads(self, device: str) -> list[_Upload]:
        return list(self._uploads.get(device, {}).values())

    def _upload(self, device: str, upload_id: str) -> _Upload | None:
        return self._uploads.get(device, {}).get(upload_id)

    def _prune_uploads(self, device: str) -> None:
        finished = [u for u in self._device_uploads(device) if u.state != pb.INCOMPLETE]
        for upload in finished[:max(0, len(finished) - self.finished_uploads_kept)]:
            del self._uploads[device][upload.upload_id]

    def _wake(self, device: str) -> None:
        """Wake the device's held FetchTask call (a task opened, or its session ended)."""
        wake = self._device_wake.get(device)
        if wake is not None:
            wake.notify_all()

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
        expected = self._decoy if token is None else token.encode()
        # Unknown device and wrong token: the same comparison and the same answer.
        if not hmac.compare_digest(expected, request.token.encode()) or token is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"device {request.device_id!r} is unknown or its token is wrong")
        session = secrets.token_hex(16)
        with self._lock:
            sessions = self._device_sessions.setdefault(request.device_id, [])
            while len(sessions) >= self.max_sessions_per_device:
                self._sessions.pop(sessions.pop(0), None)
            sessions.append(session)
            self._sessions[session] = request.device_id
        return pb.RegisterReply(session_id=session, poll_interval_s=self.poll_interval_s,
                                max_wait_s=self.max_wait_s)

    def FetchTask(self, request: pb.FetchTaskRequest,  # noqa: N802
                  context: grpc.ServicerContext) -> pb.FetchTaskReply:
        """The device's open task (the same one until its update is delivered), if any.

        With ``wait_s`` the call is held (long poll) until a task opens for the device, up to
        ``min(wait_s, max_wait_s)``, if the device holds no other waiting call and fewer than
        ``max_waiting`` calls are held; otherwise it is answered at once.
        """
        with self._lock:
            device = self._device(request.session_id, context)
            task = self._ready_task(device)
            wait_s = min(float(request.wait_s), self.max_wait_s) if math.isfinite(
                request.wait_s) else 0.0
            if (task is None and wait_s > 0 and not self._waiting.get(device)
                    and sum(self._waiting.values()) < self.max_waiting):
                self._waiting[device] = 1
                try:
                    deadline = time.monotonic() + wait_s
                    while task is None and not self._stopping.is_set() and context.is_active():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        # Wake at least every second to notice a phone that hung up.
                        self._device_wake.setdefault(
                            device, threading.Condition(self._mutex)).wait(min(left, 1.0))
                        if self._sessions.get(request.session_id) != device:
                            break  # the session ended (a newer Register took its place)
                        task = self._ready_task(device)
                finally:
                    self._waiting.pop(device, None)
            if task is None:
                return pb.FetchTaskReply(has_task=False)
            offered = list(request.initial_model_sha256)[:8]  # a phone builds two forms
            use_patch = (task.patch is not None
                         and request.held_model_version == task.base_version
                         # A phone that holds only what its export builds gets a patch on the
                         # version 0 it names; one that holds a model it was sent, on that.
                         and (not offered or bool(task.base_sha256)
                              and task.base_sha256 in offered))
            config_json = json.dumps(task.config, sort_keys=True)
            digest = hashlib.sha256(config_json.encode()).hexdigest()
            return pb.FetchTaskReply(
                has_task=True, task_id=task.task_id, server_round=task.server_round,
                model_version=task.model_version,
                encoding=pb.SPARSE_PATCH if use_patch else pb.DENSE,
                base_version=task.base_version if use_patch else -1,
                model_bytes=task.patch if use_patch else task.dense_model,
                base_sha256=task.base_sha256 if use_patch and offered else "",
                # What the phone already holds is not sent again (it names it by digest).
                config_json="" if request.held_config_sha256 == digest else config_json,
                config_sha256=digest,
                ack_sequence=task.ack_sequence, sequence=task.sequence,
                max_chunk_bytes=self.max_chunk_bytes,
                max_update_bytes=self._update_cap(task), shared_mask=task.shared_mask or b"",
                initial_sha256=task.initial_sha256,
                patch_context=task.patch_context if use_patch else [])

    def _ready_task(self, device: str) -> PhoneTask | None:
        task = self._open.get(device)
        return None if task is None or task.task_id in self._results else task

    def _update_cap(self, task: PhoneTask) -> int:
        masks = self._masks.get(task.task_id)
        side = masks.max_bytes if masks is not None else 0
        return min(self.max_update_bytes, update_cap_bytes(len(task.dense_model)) + side)

    def UploadUpdate(self, request_iterator: Iterator[pb.UploadChunk],  # noqa: N802
                     context: grpc.ServicerContext) -> pb.UploadStatus:
        """Append chunks at the received offset; a cut stream keeps what arrived.

        The session comes from the call metadata and is checked before the first chunk is
        awaited; the stream then counts against its device's and the bridge's bounds.
        """
        session = dict(context.invocation_metadata() or ()).get(SESSION_METADATA_KEY)
        if not session:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"UploadUpdate needs the session in call metadata "
                          f"{SESSION_METADATA_KEY!r}")
        with self._lock:
            device = self._device(str(session), context)
            stream_id = self._open_stream(device, context)
        upload: _Upload | None = None
        try:
            for chunk in request_iterator:
                with self._lock:
                    self._streams[stream_id].last_seen = time.monotonic()
                    if chunk.session_id and chunk.session_id != session:
                        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                      "chunk's session_id differs from the stream's session")
                    device = self._device(str(session), context)  # ended by a new Register?
                    upload = self._accept_chunk(device, chunk, context)
        except grpc.RpcError:
            # The watchdog cancelled an idle stream: the call is over, nothing to answer.
            if self._streams[stream_id].expired:
                return pb.UploadStatus()
            raise
        finally:
            with self._lock:
                del self._streams[stream_id]
        if upload is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload stream carried no chunk")
        with self._lock:
            return self._status(upload)

    def _open_stream(self, device: str, context: grpc.ServicerContext) -> int:
        mine = sum(1 for s in self._streams.values() if s.device_id == device)
        if mine >= self.max_streams_per_device:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"device {device!r} already has {mine} upload streams open (at most "
                          f"{self.max_streams_per_device}); close one first")
        if len(self._streams) >= self.max_streams:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the bridge has {len(self._streams)} upload streams open (at most "
                          f"{self.max_streams}); retry later")
        self._next_stream += 1
        self._streams[self._next_stream] = _Stream(device, context, time.monotonic())
        return self._next_stream

    def _watch_streams(self) -> None:
        """Cancel streams idle past the deadline (a cancelled stream frees its worker)."""
        period = min(1.0, self.stream_idle_timeout_s / 4)
        while not self._stopping.wait(period):
            now = time.monotonic()
            with self._lock:
                idle = [s for s in self._streams.values()
                        if not s.expired and now - s.last_seen > self.stream_idle_timeout_s]
                for stream in idle:
                    stream.expired = True
            for stream in idle:
                stream.context.cancel()

    def _accept_chunk(self, device: str, chunk: pb.UploadChunk,
                      context: grpc.ServicerContext) -> _Upload:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        upload = self._upload(device, chunk.upload_id)
        if upload is None:
            task = self._open.get(device)
            if task is None or task.task_id != chunk.task_id:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"task {chunk.task_id!r} is not open for device {device!r}")
            if not chunk.upload_id or len(chunk.upload_id) > 128:
                context.abort(bad, f"upload_id must be 1-128 characters, got "
                                   f"{chunk.upload_id[:140]!r}")
            cap = self._update_cap(task)
            if not 0 < chunk.total_bytes <= cap:
                context.abort(bad, f"total_bytes must be in [1, {cap}] for this task's model, "
                                   f"got {chunk.total_bytes}")
            if len(chunk.sha256) != 64 or any(c not in "0123456789abcdef" for c in chunk.sha256):
                context.abort(bad, f"sha256 must be 64 lowercase hex digits, got "
                                   f"{chunk.sha256[:80]!r}")
            try:
                metrics = parse_metrics(chunk.metrics_json)
            except ValueError as ex:
                context.abort(bad, str(ex))
            masks = self._masks.get(task.task_id)
            side_cap = 0 if masks is None else min(masks.max_bytes, chunk.total_bytes - 1)
            if not 0 <= chunk.side_bytes <= side_cap:
                context.abort(bad, f"side_bytes must be in [0, {side_cap}] for this task "
                                   f"({'its shared_mask' if masks else 'it has no shared_mask'}"
                                   f"), got {chunk.side_bytes}")
            # Every check of a first chunk comes before the upload is kept: a refused one must
            # not hold one of the device's partial-upload slots.
            if chunk.offset != 0:
                context.abort(grpc.StatusCode.OUT_OF_RANGE,
                              f"the first chunk of upload {chunk.upload_id[:128]!r} starts at "
                              f"offset {chunk.offset}, expected 0")
            if len(chunk.data) > min(self.max_chunk_bytes, chunk.total_bytes):
                context.abort(bad, f"first chunk of {len(chunk.data)} bytes exceeds "
                                   f"max_chunk_bytes {self.max_chunk_bytes} or total_bytes "
                                   f"{chunk.total_bytes}")
            partial = sum(1 for u in self._device_uploads(device) if u.state == pb.INCOMPLETE)
            if partial >= self.max_partial_uploads_per_device:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"device {device!r} already has {partial} incomplete uploads (at "
                              f"most {self.max_partial_uploads_per_device}); finish one first")
            upload = _Upload(chunk.upload_id, device, chunk.task_id, chunk.total_bytes,
                             chunk.sha256, metrics, int(chunk.side_bytes))
            self._uploads.setdefault(device, {})[chunk.upload_id] = upload
        if (chunk.task_id, chunk.total_bytes, chunk.sha256, chunk.side_bytes) != (
                upload.task_id, upload.total_bytes, upload.sha256, upload.side_bytes):
            context.abort(bad, f"chunk of upload {upload.upload_id!r} disagrees with its first "
                               f"chunk on task_id, total_bytes, sha256 or side_bytes")
        if len(chunk.data) > self.max_chunk_bytes:
            context.abort(bad, f"chunk of {len(chunk.data)} bytes exceeds max_chunk_bytes "
                               f"{self.max_chunk_bytes}")
        received = upload.received
        if upload.state != pb.INCOMPLETE:
            return upload  # a repeat after the end changes nothing
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
        upload.received = len(upload.data)
        if upload.received == upload.total_bytes:
            self._complete(upload)
            self._prune_uploads(device)
        return upload

    def _complete(self, upload: _Upload) -> None:
        data = bytes(upload.data)
        task = self._tasks.get(upload.task_id)
        if task is None or self._open.get(upload.device_id) is not task:
            # _close marks the partial uploads of a closed task; this is the safety net.
            upload.finish(pb.MISSED_ROUND, f"task {upload.task_id!r} is no longer awaited; "
                                           f"the update was not aggregated")
            return
        cut = len(data) - upload.side_bytes
        side, entries = data[cut:], 0
        try:
            if hashlib.sha256(data).hexdigest() != upload.sha256:
                raise ValueError("sha256 of the received bytes does not match the declared one")
            update = decode_update(task, data[:cut], self._masks.get(task.task_id))
            if update.sequence != task.sequence:
                raise ValueError(f"update carries sequence {update.sequence}, the task asked "
                                 f"for {task.sequence}")
            masks = self._masks.get(task.task_id)
            if side and masks is not None:
                entries = masks.check(side)
        except (ValueError, dgc.DecodeError) as ex:
            upload.finish(pb.REJECTED, str(ex))
            return
        upload.finish(pb.DELIVERED, "handed to the federation")
        self._results[task.task_id] = PhoneResult(task.task_id, upload.upload_id, data[:cut],
                                                  update, upload.metrics, side, entries)
        self._task_done[task.task_id].notify_all()

    def _status(self, upload: _Upload) -> pb.UploadStatus:
        return pb.UploadStatus(upload_id=upload.upload_id, received_bytes=upload.received,
                               total_bytes=upload.total_bytes,
                               complete=upload.state != pb.INCOMPLETE, state=upload.state,
                               detail=upload.detail)

    def QueryUpload(self, request: pb.QueryUploadRequest,  # noqa: N802
                    context: grpc.ServicerContext) -> pb.UploadStatus:
        """How many bytes of an upload arrived (0 for an upload this device never sent)."""
        with self._lock:
            device = self._device(request.session_id, context)
            upload = self._upload(device, request.upload_id)
            if upload is None:
                return pb.UploadStatus(upload_id=request.upload_id)
            return self._status(upload)

    def Ack(self, request: pb.AckRequest,  # noqa: N802
            context: grpc.ServicerContext) -> pb.AckReply:
        """Whether an upload was delivered, and the device's last aggregated sequence."""
        with self._lock:
            device = self._device(request.session_id, context)
            upload = self._upload(device, request.upload_id)
            if upload is None:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"no upload {request.upload_id!r} from device {device!r}")
            return pb.AckReply(state=upload.state, detail=upload.detail,
                               last_aggregated_sequence=self._last_ack.get(device, -1))
