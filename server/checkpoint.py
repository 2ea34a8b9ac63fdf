"""Checkpoints of the strategy state: sealed with a SHA-256 digest, written atomically (tmp +
``os.replace``), and migrated from older layouts on load.

File layout: :data:`MAGIC`, one format byte, the 32-byte SHA-256 digest of the payload, then the
payload (``torch.save`` of the state). A file without the magic is an older, unsealed checkpoint
(``torch.save`` alone) and is still read; any damage to a sealed one is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedgc import methods
from fedgc.files import atomic_write
from fedgc.methods.registry import upgrade_run_config
from fedgc.schema import fallback_of
from fedgc.settings import ServerSettings, TrainSettings, fields_of, method_key_classes

CHECKPOINT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.pt"
#: The first bytes of a sealed checkpoint, then :data:`SEAL_FORMAT` and the digest.
MAGIC = b"FGCK"
SEAL_FORMAT = 1
_HEADER = len(MAGIC) + 1 + hashlib.sha256().digest_size


class CheckpointError(RuntimeError):
    """A checkpoint is missing a part, is damaged, or belongs to another model."""


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt``; a crash leaves the previous file intact."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / CHECKPOINT_FILE
    atomic_write(path, lambda fh: fh.write(
        seal({"checkpoint_version": CHECKPOINT_VERSION, **state})))
    return path


def seal(state: dict[str, Any]) -> bytes:
    """The bytes of a sealed checkpoint of ``state``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return MAGIC + bytes([SEAL_FORMAT]) + hashlib.sha256(payload).digest() + payload


def unseal(data: bytes, path: Path) -> bytes:
    """The payload of a sealed checkpoint (``data`` itself for an older, unsealed one), or
    CheckpointError naming ``path`` when the file is damaged."""
    if not data.startswith(MAGIC):
        return data
    if len(data) < _HEADER or data[len(MAGIC)] != SEAL_FORMAT:
        raise CheckpointError(f"checkpoint {path} is damaged or of an unknown format (format "
                              f"byte {data[len(MAGIC):len(MAGIC) + 1]!r}, expected "
                              f"{SEAL_FORMAT}); restore it or start a new run")
    payload = data[_HEADER:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) + 1:_HEADER]:
        raise CheckpointError(f"checkpoint {path} is damaged (SHA-256 mismatch over "
                              f"{len(payload)} bytes); restore it or start a new run")
    return payload


def load_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state saved in ``directory``, or None when there is no checkpoint yet."""
    path = Path(directory) / CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    payload = unseal(data, path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as ex:  # torch raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} is unreadable: {ex}") from ex
    if not isinstance(state, dict) or state.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a version-{CHECKPOINT_VERSION} fedgc "
                              f"checkpoint")
    return state


def checkpoint_round(directory: str | os.PathLike[str]) -> int | None:
    """The last round the checkpoint in ``directory`` kept (None: no checkpoint yet)."""
    state = load_checkpoint(directory)
    return None if state is None else int(state.get("completed_rounds", 0))


#: Run config keys a resumed run may change: how long and how it runs, and what it shows, not
#: what it computes (``robust`` only chooses the defaults of keys that are compared
#: themselves). Every other key must be the checkpoint's (``check_run_config``), ``client_nodes``
#: too (issue 35): a client key served by another node than the one that kept its residual, or
#: a binding dropped on resume, changes who the server trusts mid-run.
RESUMABLE_KEYS = frozenset({"rounds", "resume", "overwrite", "progress", "tensorboard",
                            "round_timeout_s", "robust",
                            "fraction_evaluate", "results_dir", "run_name", "sim.engine",
                            "sim.cpus_per_client", "sim.num_cpus", "sim.ray_address",
                            "sim.device", "sim.gpus_per_client"})


#: Keys that a run of before them ran without, and what a checkpoint lacking them stands for:
#: those filled by ``robust`` (empty by default: no direction gate before issue 35, no memory
#: of its left-outs before gate_memory, one radius in every round before clip_radius_clean),
#: and the emulator's compute factor (the presets' per-sample compute unscaled before
#: netem.compute_scale; every shipped model but fashion-mnist-6m's derives 1 and resumes).
ABSENT_BEFORE = {"min_cosine": -1.0, "gate_memory": 0.0, "gate_memory_below": 0.0,
                 "gate_first_bar": -1.0, "clip_radius_clean": 0.0, "netem.compute_scale": 1.0}

#: Keys that compute nothing while the key they serve is empty (or 0).
INERT_WITHOUT = {f"attack.{k}": "attack.clients" for k in (
    "kind", "norm_ratio", "weight_ratio", "target_class", "knowledge", "deviation", "epsilon")}


def check_run_config(written: Mapping[str, object] | None,
                     current: Mapping[str, object] | None,
                     defaults: Mapping[str, object] | None = None) -> None:
    """CheckpointError naming every key outside :data:`RESUMABLE_KEYS` whose value differs
    between the checkpointed run (``written``) and the resuming one (``current``).

    A key only one side has stands for its default (``defaults``, by default every run key's
    own: a key added to fedgc since the checkpoint was written, at its default, computes what
    the run did without it); a key without a default missing on one side is a difference (a
    ``netem.*`` key of a run with the network emulator, resumed without it, turned the virtual
    clock off mid-run). A checkpoint of a version that stored no configuration is not checked.
    """
    if written is None or current is None:
        return
    if defaults is None:
        defaults = run_key_defaults(str(written.get("method", current.get("method", ""))))
    unset = object()

    def value(side: Mapping[str, object], key: str) -> object:
        return side[key] if key in side else defaults.get(key, unset)

    def inert(key: str) -> bool:
        # A key that computes nothing while the key it serves is empty on both sides (the
        # attack's keys without hostile clients; a checkpoint of before them has none).
        serves = INERT_WITHOUT.get(key)
        return serves is not None and not value(written, serves) and not value(current, serves)

    changed = sorted(k for k in (set(written) | set(current)) - RESUMABLE_KEYS
                     if value(written, k) != value(current, k) and not inert(k))
    if changed:
        def shown(side: Mapping[str, object], key: str) -> str:
            v = value(side, key)
            return "unset" if v is unset else repr(v)

        what = ", ".join(f"{k} = {shown(written, k)} (now {shown(current, k)})" for k in changed)
        raise CheckpointError(f"the checkpoint was written by a run with {what}; resume it with "
                              f"the same values (only {sorted(RESUMABLE_KEYS)} may change) or "
                              f"start a new run")


def run_key_defaults(method: str = "") -> dict[str, object]:
    """Every run key (:mod:`fedgc.keys`' ServerSettings and TrainSettings, and the own keys of
    every method known here) with its default; a key whose default each method sets has
    ``method``'s (a checkpoint written before the key existed ran with it, or one of another
    method's keys that its run carried before the methods declared their own), None for a
    method not registered here; a key of :data:`ABSENT_BEFORE` what runs of before it ran
    with."""
    own = methods.get(method).defaults if method in methods.names() else None
    out: dict[str, object] = {}
    for cls in (ServerSettings, TrainSettings, *method_key_classes()):
        for f in fields_of(cls):
            key = f.metadata["key"]
            if "fallback" not in f.metadata:
                # A key still None is written as "" in a run config (fedgc.schema).
                out[key] = "" if f.default is None else f.default
            elif own is not None:
                out[key] = own.get(key, fallback_of(f))
            else:
                out[key] = None if cls in (ServerSettings, TrainSettings) else ""
    out.update(ABSENT_BEFORE)
    return out


#: The layout of :meth:`server.strategy.DGCStrategy.state_dict` (older layouts are upgraded by
#: :func:`migrate_strategy_state`). 2: the method's state under ``method`` (its aggregator and
#: round channel: DGC's ``shared_planner`` of 1), extensions' columns under ``extra``, the run
#: config in one key per setting for every method.
STRATEGY_STATE_VERSION = 2
#: Round record fields of version 1 that the network emulator now adds as its columns.
_EMULATOR_FIELDS = ("virtual_seconds", "dropped_deadline", "dropped_link", "dropped_rejected")


def _from_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 state in version 2's layout: the sign channel's planner becomes the method's
    channel state; the emulator's four round fields become extension columns (of a run that
    had the emulator: some virtual time; others drop them, all zeros); renamed keys of the run
    config (:func:`fedgc.methods.registry.upgrade_run_config`)."""
    emulated = any(r.get("virtual_seconds") for r in state["rounds"])
    rounds = []
    for r in state["rounds"]:
        r = dict(r)
        extra = {k: r.pop(k) for k in _EMULATOR_FIELDS if k in r}
        r["extra"] = extra if emulated else {}
        rounds.append(r)
    state["rounds"] = rounds
    state["client_rows"] = [{**row, "extra": {}} for row in state["client_rows"]]
    state["method"] = {"aggregator": {}, "channel": state.pop("shared_planner", None)}
    if state.get("run_config") is not None:
        state["run_config"] = upgrade_run_config(dict(state["run_config"]))
    state["strategy_state_version"] = STRATEGY_STATE_VERSION
    return state


def migrate_strategy_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the current layout; CheckpointError for a strategy state version this fedgc
    does not read.

    Version 1 is upgraded (:func:`_from_version_1`). Older checkpoints of version 1 kept one
    ``version`` per client (-1: unknown) instead of ``versions``, and past models instead of
    ``changed_at`` (then every entry counts as changed at the checkpoint's version: patches
    only from then on).
    """
    version = state.get("strategy_state_version")
    if version not in (1, STRATEGY_STATE_VERSION):
        raise CheckpointError(f"strategy state version {version} is not one this fedgc reads "
                              f"(1 or {STRATEGY_STATE_VERSION}); start a new run")
    state = dict(state)
    if version == 1:
        state = _from_version_1(state)
    if "virtual_now_s" in state:
        # The network emulator's clock, kept by its strategy subclass until issue 36, is its
        # extension's state now: the first of its two, which kept nothing then.
        clock = state.pop("virtual_now_s")
        extensions = [dict(e) for e in state.get("extensions", [])]
        empty = [e for e in extensions if not e]
        if empty:
            empty[0]["virtual_now_s"] = clock
        state["extensions"] = extensions
    clients = {}
    for key, info in state["clients"].items():
        if "versions" in info:
            versions = [int(v) for v in info["versions"]]
        else:
            versions = [int(info["version"])] if int(info.get("version", -1)) >= 0 else []
        clients[key] = {"acked": int(info["acked"]), "versions": versions}
    state["clients"] = clients
    if "changed_at" not in state:
        version = int(state["model_version"])
        state["changed_at"] = {k: torch.full(tuple(v.shape), version, dtype=torch.int32)
                               for k, v in state["model"].items()}
    return state
