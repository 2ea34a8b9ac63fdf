"""bench/flower_secaggplus.py: Flower's own SecAgg+ workflow run in process, its bytes counted
(the denominator of issue 38's uplink target, docs/privacy.md)."""

from __future__ import annotations

from flwr.supercore.task_identity import TaskIdentity

from bench.flower_secaggplus import WIRE_PROFILES, run


def test_flower_secaggplus_sums_and_its_masked_vector_costs_8_bytes_a_coordinate():
    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    out = run(4, 3, 2, [(50,), (10, 20)])
    # Flower's workflow ran all four stages, one request and one reply per client each
    assert set(out["stages"]) == {"setup", "share_keys", "collect_masked_vectors", "unmask"}
    assert all(v["messages"] == 4 for v in out["stages"].values())
    # and its mean is the clients' mean within its fixed point (2^22 levels over [-8, 8])
    assert out["max_error_of_mean"] < 1e-4
    # int64 through np.save: 8 bytes a coordinate, plus headers and the weight's coordinate
    assert 8.0 < out["masked_bytes_per_coordinate"] < 8.0 + 2000 / out["coordinates"]
    for name in WIRE_PROFILES:
        assert out["wire_up_per_client"][name]["total"] > out["up_per_client"]
    assert (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id) == before
