"""ClientStateStore: records round-trip, writes are atomic, bad keys and damaged files fail."""

import pytest
import torch

from client.state import ClientStateStore, StateStoreError


def test_round_trip_and_replace(tmp_path):
    store = ClientStateStore(tmp_path / "s")
    assert store.get("7") is None
    store.put("7", {"v": torch.arange(5.0), "version": 3})
    store.put("7", {"v": torch.ones(2), "version": 4})
    got = store.get("7")
    assert got["version"] == 4 and torch.equal(got["v"], torch.ones(2))
    assert store.keys() == ["7"]
    # No temporary files are left behind by the atomic writes.
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["7.pt"]
    store.delete("7")
    assert store.get("7") is None and store.keys() == []


@pytest.mark.parametrize("key", ["../x", "", "a/b", "x" * 200])
def test_bad_key_is_refused(tmp_path, key):
    with pytest.raises(StateStoreError, match="client key"):
        ClientStateStore(tmp_path).put(key, {})


def test_damaged_record_names_the_file_and_keeps_nothing_else(tmp_path):
    store = ClientStateStore(tmp_path)
    store.put("1", {"v": torch.zeros(3)})
    (tmp_path / "2.pt").write_bytes(b"not a torch file")
    with pytest.raises(StateStoreError, match="2.pt"):
        store.get("2")
    assert torch.equal(store.get("1")["v"], torch.zeros(3))


def test_record_must_be_a_dict(tmp_path):
    store = ClientStateStore(tmp_path)
    with pytest.raises(StateStoreError, match="dict"):
        store.put("1", [1, 2])  # type: ignore[arg-type]
    assert store.get("1") is None


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden.weight": torch.randn(120, 100, generator=g),
            "hidden.bias": torch.randn(120, generator=g),
            "out.weight": torch.randn(10, 120, generator=g)}


@pytest.mark.parametrize("small_density", [0.0, 0.1])
def test_compressor_state_round_trips_through_the_store(tmp_path, small_density):
    """What client.app stores continues bit-identically, and restore() works after the trip."""
    import dgc
    from client.settings import TrainSettings

    settings = TrainSettings(density=0.01, small_density=small_density, warmup="none",
                             selection="exact", min_sparse_numel=100)
    kept = settings.compressor()
    assert type(kept).__name__ == ("DGCCompressor" if small_density == 0 else
                                   "TwoDensityCompressor")
    pending = kept.compress(_grads(0), sequence=1)
    store = ClientStateStore(tmp_path)
    store.put("3", {"compressor": kept.state_dict()})
    loaded = settings.compressor()
    loaded.load_state_dict(store.get("3")["compressor"])
    for k, v in kept.residual().items():
        assert torch.equal(loaded.residual()[k], v)

    # The next step gives the same update from the loaded and the kept compressor.
    a, b = kept.compress(_grads(1), sequence=2), loaded.compress(_grads(1), sequence=2)
    assert dgc.encode(a) == dgc.encode(b)
    # out.weight (1,200 entries) is small: ceil(0.1 * 1200) entries instead of ceil(0.01 * 1200).
    assert a.tensors["out.weight"].indices.numel() == (120 if small_density else 12)

    # restore() of the unapplied first update adds exactly its values back to the residual.
    before = {k: v.clone() for k, v in loaded.residual().items()}  # residual() is live
    loaded.restore(pending)
    for name, t in pending.tensors.items():
        diff = loaded.residual()[name] - before[name]
        torch.testing.assert_close(diff, t.to_dense().reshape(-1).float(), rtol=0, atol=1e-6)
