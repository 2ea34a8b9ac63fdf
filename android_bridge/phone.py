"""A reference phone client in Python: the exported ``.pte`` files and the gRPC stubs, nothing more.

It does what the Android app does (``android_bridge/android/``): register with its device id and
token over TLS, fetch a task, rebuild the global model from the wire-format bytes, train with
``train_step.pte`` (ExecuTorch training API and SGD), form the pseudo-gradient
``global - local``, fold a never-aggregated previous update back into the residual, compress
with ``encoder.pte``, answer the round's shared index sets with its residual's signs, and upload
the ``dgc.encode``-d update (and the signs) in chunks that resume after a cut.

A round is a simulated client's round (``client.app``), step for step: the same minibatches in
the same order (:mod:`android_bridge.shuffle`: torch's generator and ``randperm``), SGD with the
run's ``client_momentum`` and ``weight_decay`` from fresh buffers, the pseudo-gradient, the
fold-back of an update the server did not aggregate (the update, then its signs), DGC with a
second density for small tensors (``dgc.small_density``), with ``dgc.value_levels`` its values
on a grid (the rounding back into the residual), then the sign channel
(``dgc.signs.take_signs`` on the residual, or ``take_values`` under ``dgc.shared_values =
grid``): :func:`encoder_round`. A task whose ``codec`` names a payload (random-k's
``seeded``, EF-signSGD's ``signs``) is compressed on the host instead
(:mod:`android_bridge.host_encoders`) and sent in that payload's bytes.
Given the same data and seed, and a training step
that computes what eager torch computes, it sends the same bytes (tests/test_phone_parity.py).
Sets ranked by displacement (``dgc.shared_rank = displacement``: the task's ``shared_mask`` a
rank request) are derived on the phone from the model it trains on and the version 0 its export
builds (the form the task's ``initial_sha256`` names), with
``dgc.signs.planner.displacement_masks``, as the simulated client derives them; a patch ranked by
displacement (``downlink_context``: the task's ``patch_context``) is joined on the same ranking
of the model it holds (:func:`apply_context_patch`), and a compact patch (``downlink_compact``,
``FGCK``) is read on the layout of that model and those segments, as a simulated client reads it.
Torch appears as the buffer type of the ExecuTorch Python bindings, in the sign channel's
scale, a float32 mean (``dgc.signs``), and in those rankings (a stable sort); other host
arithmetic is numpy, as it would be plain Java on the phone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

import dgc
from android_bridge.bridge import PHONE_CHANNEL_OPTIONS, SESSION_METADATA_KEY
from android_bridge.encoder import check_compatible
from android_bridge.host_encoders import HostEncoder, host_encoder
from android_bridge.initial_model import FORMS, initial_form
from android_bridge.proto import fedgc_bridge_pb2 as pb
from android_bridge.proto import fedgc_bridge_pb2_grpc as pb_grpc
from android_bridge.runtime import PteEncoder, PteTrainer, load_manifest
from android_bridge.shuffle import local_batches
from dgc.config import DGCConfig
from dgc.signs import decode_mask, encode_signs, take_signs
from dgc.signs.client import take_values, values_on_grid
from dgc.signs.codec import RANK_MAGIC, Masks, decode_rank_request, encode_values
from dgc.signs.planner import displacement_masks
from dgc.wire import max_numel_of
from fedgc.patching import ProtocolError, apply_patch
from fedgc.training import round_seed


class PhoneError(RuntimeError):
    """The phone cannot run the task it was given (incompatible config or batch layout)."""


def encoder_round(encoder: Any, pseudo_gradient: Mapping[str, np.ndarray], epoch: float,
                  sequence: int, values: Mapping[str, float], masks: Masks | None,
                  started: bool = True,
                  ) -> tuple[dgc.SparseUpdate, bytes, dgc.SparseUpdate | None, bytes]:
    """A round of the exported encoder with the host code around it, in the simulated
    ``dgc`` client's order: the top-k of ``encoder`` (:class:`android_bridge.runtime.PteEncoder`
    or anything with its ``compress``, ``residual`` and ``restore``); with ``values["levels"]``
    (``dgc.value_levels``) its values on a power-of-two grid and the rounding back into the
    residual (:func:`fedgc.methods.dgc.values_on_grid`); then the residual at the round's
    ``masks`` taken out as scaled signs, or with ``values["shared_levels"]``
    (``dgc.shared_values = grid``) as grid values (``dgc.signs.take_signs``, ``take_values``).
    With ``values["first"]`` (``dgc.shared_first``) the sets come first, as the simulated
    client's ``RoundCompressor._take_first``: the pseudo-gradient at the sets joins the
    residual there and leaves with it, and the top-k gets the pseudo-gradient zeroed there;
    an encoder that has not compressed yet (``started`` False: a simulated client's compressor
    holds no residual then) takes the sets from the pseudo-gradient alone and puts what they
    leave back after the top-k. The update, its bytes, what the sets sent (None without sets)
    and its bytes."""
    shared_levels = float(values.get("shared_levels", 0.0))

    def take(source: Mapping[str, torch.Tensor]) -> tuple[dgc.SparseUpdate, bytes]:
        if shared_levels > 0:
            sent = take_values(source, masks, sequence, shared_levels)
            return sent, encode_values(sent)
        sent = take_signs(source, masks, sequence)
        return sent, encode_signs(sent)

    taken, left = None, None
    if masks is not None and values.get("first"):
        grads = {n: np.asarray(g, dtype=np.float32) for n, g in pseudo_gradient.items()}
        residual = encoder.residual()
        source: dict[str, torch.Tensor] = {}
        for name, mask in masks.items():
            if name not in grads:
                continue
            idx = np.asarray(mask, dtype=np.int64)
            flat = grads[name].reshape(-1)
            at = torch.from_numpy(flat[idx].copy())
            if started:
                residual[name].index_add_(0, torch.from_numpy(idx), at)
                source[name] = residual[name]
            else:
                source[name] = torch.zeros(flat.size, dtype=torch.float32)
                source[name][torch.from_numpy(idx)] = at
            off = flat.copy()
            off[idx] = 0.0
            grads[name] = off.reshape(grads[name].shape)
        taken = take(source)
        if not started:  # the sets' remainder, back after the top-k
            left = dgc.SparseUpdate({n: dgc.SparseTensor(t.indices, source[n][t.indices], t.shape)
                                     for n, t in taken[0].tensors.items()}, sequence)
        pseudo_gradient = grads
    update = encoder.compress(pseudo_gradient, epoch=epoch, sequence=sequence)
    if left is not None and left.tensors:
        encoder.restore(left)
    levels = float(values.get("levels", 0.0))
    if levels > 0:
        update, error = values_on_grid(update, levels)
        encoder.restore(error)
    data = dgc.encode(update, grid_coding=levels > 0)
    if masks is None:
        return update, data, None, b""
    sent, side = taken if taken is not None else take(encoder.residual())
    return update, data, sent, side


def _torch(model: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in
            model.items()}


def derive_sets(rank_request: bytes, model: Mapping[str, np.ndarray],
                version_0: Mapping[str, np.ndarray]) -> Masks:
    """The shared sets a rank request (``dgc.signs.codec.encode_rank_request``) stands for:
    per tensor the entries where ``|model - version_0|`` is largest, ties to the lower index,
    with the draw the request asks for (:func:`dgc.signs.planner.displacement_masks`, as the
    simulated client's ``DGC.hold_material``). ``model`` is the round's model, ``version_0``
    in the form the task names. ``dgc.DecodeError`` or ``dgc.StateError`` naming a defect."""
    numels = {name: int(np.asarray(v).size) for name, v in model.items()}
    sequence, counts, _, explore = decode_rank_request(rank_request, numels)
    if missing := sorted(set(counts) - set(version_0)):
        raise dgc.StateError(f"rank request names tensors version 0 lacks: {missing}")
    return displacement_masks(_torch(model), _torch({n: version_0[n] for n in counts}),
                              counts, explore, sequence)


def apply_context_patch(held: Mapping[str, np.ndarray], patch: bytes, context: list[str],
                        version_0: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model a patch makes of ``held`` (left unchanged), as a simulated client applies it
    (:func:`fedgc.patching.apply_patch`), every value replacing an entry: an update message or
    a compact one (``downlink_compact``, on the layout of the model and the segments of its
    ``context`` tensors); the ``context`` tensors (none: ``[]``) travel as segments of their
    entries ranked by displacement of ``held`` from ``version_0`` (``downlink_context``) and
    are joined on that ranking. ``fedgc.protocol.ProtocolError`` (or ``dgc.DecodeError``)
    naming a patch that does not fit."""
    if missing := sorted(set(context) - set(version_0)):
        raise ProtocolError(f"patch_context names tensors version 0 lacks: {missing}")
    model = apply_patch(_torch(held), patch, (), _torch({n: version_0[n] for n in context}))
    return {k: v.numpy() for k, v in model.items()}


class LinkCut(ConnectionError):
    """Raised inside an upload stream to emulate a link that drops mid-transfer."""


@dataclass
class RoundReport:
    """What one round on the phone did."""

    task_id: str
    server_round: int
    upload_id: str
    uplink_bytes: int
    resume_offsets: list[int]
    restored: bool
    train_loss: float
    ack_state: int
    downlink: str = "dense"  # how the model came: "dense", or "patch" on the held version
    downlink_bytes: int = 0  # its wire-format bytes
    side_bytes: int = 0
    #: The bytes uploaded: the update, then the signs (the last ``side_bytes``).
    data: bytes = b""


class ReferencePhone:
    """One phone: its exported files, its local data, its DGC state and its bridge session.

    Parameters
    ----------
    export_dir : str or Path
        Output of ``python -m android_bridge export``.
    device_id, token : str
        This phone's identity with the bridge.
    target : str
        ``host:port`` of the bridge.
    x, y : numpy arrays
        The phone's own training data (float32 inputs, int64 labels).
    root_certificates : bytes or None
        PEM of the CA that signed the bridge's certificate; None connects in plaintext (tests).
    server_name : str or None
        Host name to check the certificate against when ``target`` is an address.
    """

    def __init__(self, export_dir: str | Path, device_id: str, token: str, target: str,
                 x: np.ndarray, y: np.ndarray, root_certificates: bytes | None = None,
                 server_name: str | None = None) -> None:
        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(export_dir)
        self.device_id, self.token = device_id, token
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.y = np.ascontiguousarray(y, dtype=np.int64)
        if len(self.x) != len(self.y) or len(self.x) == 0:
            raise PhoneError(f"phone data needs as many labels as inputs and at least one "
                             f"example, got {len(self.x)} inputs and {len(self.y)} labels")
        options = list(PHONE_CHANNEL_OPTIONS)
        if root_certificates is None:
            self.channel = grpc.insecure_channel(target, options=options)
        else:
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=root_certificates),
                options=options)
        self.stub = pb_grpc.FedgcBridgeStub(self.channel)
        self.encoder = PteEncoder.from_export(export_dir)
        self.trainer = PteTrainer(export_dir)
        self.shapes = {p["name"]: tuple(p["shape"]) for p in self.manifest["parameters"]}
        self.session_id: str | None = None
        self.model: dict[str, np.ndarray] | None = None
        self.model_version = -1
        # Version 0 as the export baked it (train_step.pte's parameters before any task), and
        # the digests of the forms of it the phone can build (android_bridge.initial_model).
        initial = self.manifest.get("initial_model") or {}
        self.initial_sha256 = [initial[k] for k in FORMS if isinstance(initial.get(k), str)]
        self.initial = self.trainer.parameters() if self.initial_sha256 else None
        # The version 0 a task's displacement ranking last named: (digest, that form).
        self._ranked_from: tuple[str, dict[str, np.ndarray]] | None = None
        self.pending: dgc.SparseUpdate | None = None
        # The host encoder a task's codec entry names (android_bridge.host_encoders), with
        # its residual, and that entry.
        self.host: HostEncoder | None = None
        self.host_codec: dict[str, Any] = {}
        self.pending_signs: dgc.SparseUpdate | None = None
        self.poll_interval_s = 0.05
        self.max_wait_s = 0.0
        # The task config last received, by digest: the bridge sends it only when it changes.
        self.config_json = ""
        self.config_sha256 = ""

    def close(self) -> None:
        """Close the gRPC channel."""
        self.channel.close()

    def register(self) -> None:
        """Open a session; a refusal raises ``grpc.RpcError`` (UNAUTHENTICATED)."""
        digest = hashlib.sha256((self.export_dir / "manifest.json").read_bytes()).hexdigest()
        reply = self.stub.Register(pb.RegisterRequest(device_id=self.device_id,
                                                      token=self.token, manifest_sha256=digest))
        self.session_id, self.poll_interval_s = reply.session_id, reply.poll_interval_s
        self.max_wait_s = reply.max_wait_s

    def wait_for_task(self, timeout_s: float) -> pb.FetchTaskReply:
        """Ask FetchTask until a task arrives: a long poll (each call held up to the bridge's
        ``max_wait_s``) when the bridge offers one, else a poll every ``poll_interval_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            started = time.monotonic()
            wait_s = min(self.max_wait_s, max(0.0, deadline - started))
            # A phone that was never sent a model offers the version 0 its export builds.
            first = self.model is None and self.initial is not None
            task = self.stub.FetchTask(pb.FetchTaskRequest(
                session_id=self.session_id, held_model_version=0 if first else self.model_version,
                wait_s=wait_s, held_config_sha256=self.config_sha256,
                initial_model_sha256=self.initial_sha256 if first else []))
            if task.has_task:
                return task
            if time.monotonic() > deadline:
                raise TimeoutError(f"no task for device {self.device_id!r} in {timeout_s} s")
            if time.monotonic() - started < max(wait_s / 2, self.poll_interval_s):
                time.sleep(self.poll_interval_s)  # answered at once: the bridge did not hold it

    # -- one round ------------------------------------------------------------------------

    def _global_model(self, task: pb.FetchTaskReply) -> dict[str, np.ndarray]:
        """The model a task sends: dense, or a patch (an update message or a compact one,
        ranked or not) applied to the model held. PhoneError naming a patch that does not fit;
        nothing the phone holds changes."""
        if task.encoding == pb.SPARSE_PATCH:
            held = self.model
            if held is None and task.base_version == 0 and task.base_sha256 \
                    and self.initial is not None:
                # The first task, a patch on version 0: built from the export, in the form
                # (as built, or on the int8 grid) whose digest the bridge named.
                held = initial_form(self.initial, task.base_sha256)
                if held is None:
                    raise PhoneError(f"patch on version 0 {task.base_sha256[:12]}, which this "
                                     f"phone's export does not build")
            elif held is None or self.model_version != task.base_version:
                raise PhoneError(f"patch on version {task.base_version}, phone holds "
                                 f"{self.model_version}")
            context = list(task.patch_context)
            try:
                return apply_context_patch(held, task.model_bytes, context,
                                           self._version_0(task) if context else {})
            except (ProtocolError, dgc.DecodeError) as ex:
                raise PhoneError(f"task {task.task_id!r}: {ex}") from ex
        update = dgc.decode(task.model_bytes, max_numel=max_numel_of(self.shapes.values()))
        if set(update.tensors) != set(self.shapes):
            raise PhoneError(f"model carries tensors {sorted(update.tensors)}, the exported "
                             f"model has {sorted(self.shapes)}")
        model = {}
        for name, shape in self.shapes.items():
            t = update.tensors[name]
            if not t.is_dense or tuple(t.shape) != shape:
                raise PhoneError(f"dense model tensor {name!r} must carry all of {shape}")
            model[name] = t.values.float().numpy().reshape(shape).copy()
        return model

    def _batches(self, train: dict[str, Any], server_round: int) -> Iterator[tuple[Any, Any]]:
        """The round's minibatches, as ``fedgc.training.train_locally`` takes them: seeded by
        the run's seed, the round and this client's key; the last batch of an epoch holds what
        is left (the training step takes 1..batch_size examples)."""
        seed = round_seed(int(train["seed"]), int(server_round), int(train.get("client_key", 0)))
        for idx in local_batches(len(self.x), int(train["batch_size"]),
                                 int(train["local_epochs"]), int(train["local_steps"]), seed):
            yield self.x[idx], self.y[idx]

    def run_round(self, task: pb.FetchTaskReply, cut_after_bytes: int | None = None,
                  max_streams: int = 8) -> RoundReport:
        """Train, compress and upload for ``task``; ``cut_after_bytes`` cuts the first stream
        after that many bytes to exercise resumption."""
        config = json.loads(self._config_of(task))
        train = config["train"]
        dgc_config = DGCConfig.from_dict(config["dgc"])
        small = config.get("small") or {}
        host = self._host_encoder(config.get("codec") or {})
        if host is None:  # a host encoder reads the config's layer policy only
            self.encoder.reconfigure(dgc_config, float(small.get("density", 0.0)),
                                     int(small.get("numel", 10_000)))
        largest = self.trainer.batch_shape[0]
        if not 1 <= int(train["batch_size"]) <= largest:
            raise PhoneError(f"task asks for batch_size {train['batch_size']}, the exported "
                             f"training step takes 1..{largest}")
        global_model = self._global_model(task)
        self.trainer.set_parameters(global_model)
        self.trainer.set_learning_rate(float(train["lr"]), float(train.get("momentum", 0.0)),
                                       float(train.get("weight_decay", 0.0)))
        losses = self.trainer.train(self._batches(train, int(task.server_round)))
        local = self.trainer.parameters()
        pseudo_gradient = {k: global_model[k] - local[k] for k in self.shapes}
        restored = self.pending is not None and self.pending.sequence != task.ack_sequence
        if restored:
            # As client.state.fold_back_pending: the update, then the signs sent beside it.
            (self.encoder if host is None else host).restore(self.pending)
            if self.pending_signs is not None:
                self.encoder.restore(self.pending_signs)
        epoch = float(task.server_round - 1)
        signs, side = None, b""
        if host is not None:
            # A host encoder's payload answers the round's mask itself (TCS); no signs beside.
            masks = self._masks(task) if host.reads_masks else None
            update = host.compress(pseudo_gradient, dgc_config, epoch, int(task.sequence),
                                   masks)
            data = host.encode(update)
        else:
            update, data, signs, side = encoder_round(
                self.encoder, pseudo_gradient, epoch, int(task.sequence),
                config.get("values") or {}, self._masks(task, global_model),
                started=self.encoder.step > 0)
        # A stateless host encoder (the vote) keeps nothing to fold back, as its client.
        kept = host is None or host.keeps_residual
        self.pending, self.pending_signs = (update if kept else None), signs
        self.model, self.model_version = global_model, int(task.model_version)
        # What the bridge app reads (it times the round itself); "restored" only when 1.
        metrics: dict[str, Any] = {"num-examples": len(self.x),
                                   # Summed in order, as fedgc.training.train_locally
                                   # averages its losses.
                                   "train_loss": sum(losses) / max(len(losses), 1)}
        if restored:
            metrics["restored"] = 1
        if not math.isfinite(metrics["train_loss"]):
            del metrics["train_loss"]  # NaN is not JSON: the bridge refuses it
        upload_id = f"{self.device_id}-{task.task_id}"
        starts, state = self.upload(task, upload_id, data + side, metrics, cut_after_bytes,
                                    max_streams, side_bytes=len(side))
        if state in (pb.UPDATE_STATE_UNSPECIFIED, pb.INCOMPLETE):
            # The stream's answer did not say how the upload ended: ask.
            state = self.stub.Ack(pb.AckRequest(session_id=self.session_id,
                                                upload_id=upload_id)).state
        return RoundReport(task.task_id, int(task.server_round), upload_id, len(data) + len(side),
                           starts, restored, metrics.get("train_loss", float("nan")), state,
                           downlink="patch" if task.encoding == pb.SPARSE_PATCH else "dense",
                           downlink_bytes=len(task.model_bytes), side_bytes=len(side),
                           data=data + side)

    def _host_encoder(self, codec: dict[str, Any]) -> HostEncoder | None:
        """The host encoder the task's ``codec`` entry names (kept, with its residual, while
        the entry stays the same), None for the exported encoder."""
        if not codec:
            return None
        if self.host is None or self.host_codec != codec:
            try:
                self.host = host_encoder(codec)
            except ValueError as ex:
                raise PhoneError(f"task's codec {codec!r}: {ex}") from ex
            self.host_codec = dict(codec)
        return self.host

    def _version_0(self, task: pb.FetchTaskReply) -> dict[str, np.ndarray]:
        """Version 0 in the form the task's ``initial_sha256`` names (as the export built it,
        or on the int8 grid), kept by digest; PhoneError when the export builds neither."""
        digest = task.initial_sha256
        if self._ranked_from is None or self._ranked_from[0] != digest:
            form = (initial_form(self.initial, digest)
                    if self.initial is not None and digest else None)
            if form is None:
                raise PhoneError(f"task {task.task_id!r} ranks by displacement from version 0 "
                                 f"{digest[:12] or '(unnamed)'}, which this phone's export does "
                                 f"not build (export it with the run's task and seed)")
            self._ranked_from = (digest, form)
        return self._ranked_from[1]

    def _masks(self, task: pb.FetchTaskReply,
               model: Mapping[str, np.ndarray] | None = None) -> Masks | None:
        """The task's round material, its shared index sets (``dgc``) or mask (``tcs``),
        decoded against the exported model, or derived from the round's ``model`` when it is a
        rank request (:func:`derive_sets`); None when the task has none."""
        if not task.shared_mask:
            return None
        numels = {name: math.prod(shape) for name, shape in self.shapes.items()}
        try:
            if bytes(task.shared_mask[:4]) == RANK_MAGIC:
                if model is None:
                    raise PhoneError(f"task {task.task_id!r} sends a rank request where its "
                                     f"encoder reads a mask")
                return derive_sets(task.shared_mask, model, self._version_0(task))
            return decode_mask(task.shared_mask, numels)[1]
        except (dgc.DecodeError, dgc.StateError) as ex:
            raise PhoneError(f"task {task.task_id!r} has a bad shared_mask: {ex}") from ex

    def _config_of(self, task: pb.FetchTaskReply) -> str:
        """The task's config JSON: as sent, or the one held when the bridge left it out."""
        if task.config_json:
            digest = hashlib.sha256(task.config_json.encode()).hexdigest()
            if task.config_sha256 and digest != task.config_sha256:
                raise PhoneError(f"task config digest {task.config_sha256} does not match its "
                                 f"config_json ({digest})")
            self.config_json, self.config_sha256 = task.config_json, digest
        elif not task.config_sha256 or task.config_sha256 != self.config_sha256:
            raise PhoneError(f"task {task.task_id!r} carries no config and names "
                             f"{task.config_sha256!r}, which this phone does not hold")
        return self.config_json

    def upload(self, task: pb.FetchTaskReply, upload_id: str, data: bytes,
               metrics: dict[str, Any], cut_after_bytes: int | None = None,
               max_streams: int = 8, side_bytes: int = 0) -> tuple[list[int], int]:
        """Send ``data`` in chunks, resuming from QueryUpload after a cut; return the offset
        each stream started at and the upload's state as the last answer gave it.
        ``side_bytes``: how many bytes at the end are the signs.

        The first stream starts at 0 without asking (a new upload id has nothing stored);
        QueryUpload is asked only after a stream broke."""
        digest = hashlib.sha256(data).hexdigest()
        chunk_bytes = int(task.max_chunk_bytes) or 64 * 1024
        metrics_json = json.dumps(metrics, sort_keys=True)

        def delivered() -> int:
            return int(self.stub.QueryUpload(pb.QueryUploadRequest(
                session_id=self.session_id, upload_id=upload_id)).received_bytes)

        def chunks(start: int, cut: int | None) -> Iterator[pb.UploadChunk]:
            for offset in range(start, len(data), chunk_bytes):
                if cut is not None and offset >= cut:
                    # The emulated link drops once what was sent before the cut has arrived, so
                    # the resumption point is deterministic (a real cut may lose chunks in
                    # flight; QueryUpload then reports less, and resuming works the same way).
                    deadline = time.monotonic() + 10.0
                    while delivered() < offset and time.monotonic() < deadline:
                        time.sleep(0.005)
                    raise LinkCut(f"link cut after {offset} bytes")
                # The session travels in the stream's metadata; the chunk leaves it out.
                yield pb.UploadChunk(task_id=task.task_id,
                                     upload_id=upload_id, offset=offset,
                                     data=data[offset:offset + chunk_bytes],
                                     total_bytes=len(data), sha256=digest,
                                     metrics_json=metrics_json, side_bytes=side_bytes)

        starts: list[int] = []
        offset = 0
        for stream in range(1, max_streams + 1):
            if stream > 1:
                status = self.stub.QueryUpload(pb.QueryUploadRequest(
                    session_id=self.session_id, upload_id=upload_id))
                if status.complete:
                    return starts, int(status.state)
                offset = int(status.received_bytes)
            cut = cut_after_bytes if stream == 1 else None
            starts.append(offset)
            try:
                status = self.stub.UploadUpdate(
                    chunks(offset, cut), metadata=((SESSION_METADATA_KEY, self.session_id),))
            except grpc.RpcError as ex:
                # CANCELLED also ends a stream the bridge found idle too long.
                if ex.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                                     grpc.StatusCode.UNAVAILABLE):
                    raise
                continue  # the link dropped: ask where to resume
            if status.complete:
                return starts, int(status.state)
        raise ConnectionError(f"upload {upload_id!r} incomplete after {max_streams} streams")


def compatible_config(manifest: dict[str, Any], requested: DGCConfig) -> DGCConfig:
    """``requested`` with ``selection="exact"`` (what the phone runs), checked against the
    exported config; raises ``dgc.ConfigError`` on a baked-in difference."""
    config = dataclasses.replace(requested, selection="exact")
    check_compatible(DGCConfig.from_dict(manifest["dgc_config"]), config)
    return config
