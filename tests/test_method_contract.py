"""The Method contract beyond sparse FedAvg, on a toy method of this test's own: round material
that the server plans and every client's compressor uses, a payload check against it, an
aggregator that is not a weighted mean and keeps state across rounds (in the checkpoint), all
through ``method = tests.test_method_contract:make`` with no file of fedgc changed.

The toy (``vote``): each round the server draws a mask per sparsified tensor (its Channel, with
its own state); every client sends the signs of its residual there, times their mean magnitude
(error feedback keeps the rest); the server takes the unweighted mean of the signs and keeps a
momentum of it in its aggregator (a FetchSGD-like server state) -- the shapes of signSGD with a
majority vote, time-correlated masks and server-side momentum.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from dgc import DecodeError, SparseTensor, SparseUpdate
from dgc.signs.codec import decode_mask, encode_mask
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods import (
    Aggregator,
    Bound,
    Channel,
    Codec,
    Method,
    PayloadError,
    RoundMaterial,
    SparseCodec,
    pending_parts,
)
from fedgc.settings import RunConfig
from simulations.cli import main
from tests.golden.payload_golden import records

FRACTION = 0.05


class MaskChannel(Channel):
    """A seeded random mask per tensor each round; the draws so far are its state."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], seed: int) -> None:
        self.numels = {n: int(np.prod(s)) for n, s in shapes.items() if len(s) > 1}
        self.seed, self.draws = seed, 0

    def plan(self, server_round: int) -> tuple[bytes, Any]:
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        masks = {n: np.sort(rng.choice(k, max(1, int(k * FRACTION)), replace=False))
                 for n, k in self.numels.items()}
        return encode_mask(masks, self.numels, server_round), masks

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.draws = int(state["draws"])


class SignsAtMask:
    """The residual's signs at the round's mask, times their mean magnitude (dgc.base's
    Compressor)."""

    def __init__(self, masks: Mapping[str, np.ndarray] | None) -> None:
        self.masks, self.v = masks or {}, {}

    def compress(self, grads, epoch=0.0, sequence=None) -> SparseUpdate:
        out = {}
        for name, g in grads.items():
            v = self.v.setdefault(name, torch.zeros(g.numel()))
            v += g.reshape(-1)
            idx = torch.from_numpy(self.masks.get(name, np.arange(v.numel())))
            scale = float(v[idx].abs().mean()) if idx.numel() else 0.0
            sent = torch.where(v[idx] < 0, -scale, scale)
            v[idx] -= sent
            out[name] = SparseTensor(idx, sent, tuple(g.shape))
        return SparseUpdate(out, sequence or 0)

    def restore(self, update: SparseUpdate) -> None:
        for name, t in update.tensors.items():
            self.v[name].index_add_(0, t.indices, t.values.to(torch.float32))

    def residual(self):
        return self.v

    def scale_state(self, factor: float) -> None:
        for v in self.v.values():
            v.mul_(factor)

    def state_dict(self):
        return {"v": {k: t.clone() for k, t in self.v.items()}}

    def load_state_dict(self, state):
        self.v = {k: t.clone() for k, t in state["v"].items()}


class MaskedCodec(SparseCodec):
    """fedgc's sparse payload, held to the round's mask."""

    def check(self, payload: Any, bound: Bound) -> None:
        super().check(payload, bound)
        for name, mask in (bound.material or {}).items():
            if not torch.equal(payload.update.tensors[name].indices, torch.from_numpy(mask)):
                raise PayloadError(f"tensor {name!r} is not sent at the round's mask")


class VoteMomentum(Aggregator):
    """Every client once (unweighted); the server keeps a momentum of the mean signs."""

    weighted = False

    def __init__(self) -> None:
        self.m: dict[str, torch.Tensor] | None = None

    def finish(self, combined, shapes):
        if self.m is None:
            self.m = {k: torch.zeros(v.shape) for k, v in combined.items()}
        self.m = {k: 0.9 * self.m[k] + combined[k] for k in combined}
        return self.m

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.m = state["m"]


class Vote(RoundMaterial, Method):
    name = "vote"
    description = "signs at the server's mask"
    keeps_residual = True

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> SignsAtMask:
        return SignsAtMask(material)  # type: ignore[arg-type]

    def codec(self, train: TrainSettings) -> Codec:
        return MaskedCodec(sign_coding=True)

    def read_material(self, data: bytes, numels: Mapping[str, int]) -> object:
        return decode_mask(data, numels)[1]

    def channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]]) -> Channel:
        return MaskChannel(shapes, run.train.seed)

    def aggregator(self, run: RunSettings) -> Aggregator:
        return VoteMomentum()


def make() -> Method:
    return Vote()


def _run(tmp_path, name: str, *sets: str) -> list[dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
            "num_clients=6", "--set", "clients_per_round=3", "--set", "progress=false",
            "--set", "method=tests.test_method_contract:make", "--set", "server_lr=0.1",
            "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return list(csv.DictReader((tmp_path / name / "rounds.csv").open()))


def test_material_state_and_a_stateful_unweighted_aggregator_resume_bit_for_bit(tmp_path):
    whole = _run(tmp_path, "whole", "rounds=4")
    _run(tmp_path, "part", "rounds=2")
    part = _run(tmp_path, "part", "rounds=4", "resume=true")
    assert float(whole[-1]["accuracy"]) > float(whole[0]["accuracy"])
    assert all(r["clients_aggregated"] == "3" and r["clients_rejected"] == "0" for r in whole)
    for a, b in zip(whole, part, strict=True):
        assert {k: v for k, v in a.items() if "seconds" not in k} == \
            {k: v for k, v in b.items() if "seconds" not in k}
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("whole", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_server_checks_a_payload_against_the_rounds_material():
    mask = {"w": np.array([1, 4])}
    codec = MaskedCodec(sign_coding=True)
    sent = SignsAtMask(mask).compress({"w": torch.arange(12.0).reshape(3, 4) - 6}, sequence=2)
    payload = codec.decode(codec.encode(sent), Bound({"w": (3, 4)}, 2, mask))
    codec.check(payload, Bound({"w": (3, 4)}, 2, mask))
    with pytest.raises(PayloadError, match="not sent at the round's mask"):
        codec.check(payload, Bound({"w": (3, 4)}, 2, {"w": np.array([1, 5])}))


class NeedsMask(MaskedCodec):
    """A payload read against the round's mask (as TCS's values at the server's mask are):
    without the material it does not decode."""

    kind = "toy"
    MASK = {"w": np.array([1, 4])}

    def __init__(self) -> None:
        super().__init__(sign_coding=True)
        self.seen: list[Any] = []

    def decode(self, data: bytes, bound: Bound) -> Any:
        self.seen.append(bound.material)
        if bound.material is None:
            raise DecodeError("this payload is read against the round's mask")
        return super().decode(data, bound)

    def golden_cases(self) -> list[tuple[str, Any]]:
        return [("one", SignsAtMask(self.MASK).compress({"w": torch.arange(12.0) - 6},
                                                          sequence=3))]

    def golden_bound(self, case: str) -> Bound:
        return Bound({"w": (12,)}, material=self.MASK, limit=2**62)


def test_golden_vectors_are_decoded_against_the_bound_their_codec_names():
    assert Codec().golden_bound("any") == Bound({}, limit=2**62)
    doc = records("toy", NeedsMask())
    assert [c["sequence"] for c in doc["cases"]] == [3]
    assert doc["cases"][0]["parts"][0][0]["indices"] == [1, 4]


def test_a_pending_payload_folds_back_read_against_the_material_it_answered():
    codec = NeedsMask()
    method = Vote()
    method.codec = lambda train: codec  # type: ignore[method-assign]
    pending = codec.encode(NeedsMask.golden_cases(codec)[0][1])
    sequence, parts = pending_parts(method, RunConfig().train, pending, None,
                                    encode_mask(NeedsMask.MASK, {"w": 12}, 3), {"w": (12,)})
    assert sequence == 3 and parts[0].tensors["w"].indices.tolist() == [1, 4]
    assert np.array_equal(codec.seen[-1]["w"], NeedsMask.MASK["w"])


def test_a_methods_own_keys_stay_out_of_the_other_methods_runs():
    """A method with keys of its own (``settings``) adds them to the keys a run accepts, and to
    its own runs' messages and summary.json, not to another method's: registering a method
    changes no other method's run (the fixed-seed snapshots, whose emulator charges every
    train message's bytes, hold to that)."""
    from fedgc.methods import get, registered
    from fedgc.schema import fields_of, is_sent

    def keys(m: Method, sent: bool = False) -> set[str]:
        """Its own keys (``sent``: those that travel to clients)."""
        return ({f.metadata["key"] for f in fields_of(m.settings) if is_sent(f) or not sent}
                if m.settings else set())

    own = {k for m in registered() for k in keys(m)}
    assert own and own <= set(RunConfig.keys())
    for m in registered():
        config = RunConfig.from_flat({"method": m.name, "run_name": "x"})
        assert own & set(config.to_flat()) == keys(m)
        # The keys only its server half reads (dgc's sign channel's) stay on the server.
        assert own & set(config.client_config()) == keys(m, sent=True)
        # compare's next method gets its own defaults, and no other method's keys...
        after = config.with_overrides({"method": "dense"})
        assert not own & set(after.client_config())
    # ... but a value the user gave applies to every method.
    levels = get("qsgd").settings().levels + 1
    given = RunConfig.from_flat({"method": "dense", "run_name": "x", "qsgd.levels": levels})
    assert given.client_config()["qsgd.levels"] == levels
    assert given.with_overrides({"method": "qsgd"}).method.own.levels == levels
