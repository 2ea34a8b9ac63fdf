"""fedgc.protocol: the one reply-metrics builder and patch application."""

from __future__ import annotations

import pytest
import torch

import dgc
from fedgc import protocol as P

_METRICS = dict(num_examples=12, train_loss=0.5, compute_seconds=0.1)


def test_reply_metrics_are_the_contracts_keys_typed_as_sent():
    """Only what the server reads; ``restored`` and ``state_quarantined`` only when not 0."""
    m = P.reply_metrics(**_METRICS)
    assert tuple(m) == P.REPLY_METRICS and P.STATE_QUARANTINED not in m and P.RESTORED not in m
    assert all(isinstance(m[k], float) for k in ("train_loss", "compute_seconds"))
    assert isinstance(m[P.NUM_EXAMPLES], int)
    assert P.reply_metrics(**_METRICS, state_quarantined=True)[P.STATE_QUARANTINED] == 1
    assert P.reply_metrics(**_METRICS, restored=2)[P.RESTORED] == 2
    content = P.reply_content(b"abc", m, shared_signs=b"de")
    assert P.record_to_bytes(content.array_records[P.UPDATE]) == b"abc"
    assert P.record_to_bytes(content.array_records[P.SHARED], P.SHARED_SIGNS) == b"de"
    assert dict(content.metric_records[P.METRICS]) == m


def test_the_config_digest_tells_configs_apart_by_value_and_type():
    a = {"lr": 0.1, "task": "digits", "local_epochs": 1, "flag": True, "names": ["x", "y"]}
    assert P.config_digest(a) == P.config_digest(dict(reversed(list(a.items()))))
    assert len(P.config_digest(a)) == 16
    for changed in ({"lr": 0.2}, {"local_epochs": 1.0}, {"flag": 1}, {"names": ["y", "x"]},
                    {"extra": 0}):
        assert P.config_digest({**a, **changed}) != P.config_digest(a), changed


def _patch(values: dict[str, tuple[list[int], list[float], int]]) -> bytes:
    tensors = {name: dgc.SparseTensor(torch.tensor(idx), torch.tensor(vals), (n,))
               for name, (idx, vals, n) in values.items()}
    return dgc.encode(dgc.SparseUpdate(tensors, 1))


def test_a_patch_replaces_or_adds_and_leaves_the_held_model_alone():
    held = {"a": torch.zeros(4), "b": torch.ones(3)}
    data = _patch({"a": ([1, 3], [2.0, -1.0], 4), "b": ([0], [0.5], 3)})
    out = P.apply_patch(held, data)
    assert out["a"].tolist() == [0.0, 2.0, 0.0, -1.0] and out["b"].tolist() == [0.5, 1.0, 1.0]
    added = P.apply_patch(held, data, ["b"])
    assert added["b"].tolist() == [1.5, 1.0, 1.0]
    assert held["a"].tolist() == [0.0] * 4 and held["b"].tolist() == [1.0] * 3


@pytest.mark.parametrize(("values", "added", "match"), [
    ({"c": ([0], [1.0], 2)}, [], "patch tensor 'c' does not match"),
    ({"b": ([0], [1.0], 4)}, [], "patch tensor 'b' does not match"),
    ({"a": ([0], [1.0], 4)}, ["b"], r"names tensors the patch lacks: \['b'\]"),
])
def test_a_patch_that_does_not_fit_is_a_protocol_error(values, added, match):
    held = {"a": torch.zeros(4), "b": torch.ones(3)}
    with pytest.raises(P.ProtocolError, match=match):
        P.apply_patch(held, _patch(values), added)
    assert held["a"].tolist() == [0.0] * 4


def test_a_patch_tensor_larger_than_the_held_model_is_not_decoded():
    """The decoder's bound is the held model's largest tensor: a patch claiming more entries
    is refused before anything is allocated."""
    held = {"a": torch.zeros(4), "b": torch.ones(3)}
    with pytest.raises(dgc.DecodeError, match="max_numel"):
        P.apply_patch(held, _patch({"a": ([0], [1.0], 5)}))
