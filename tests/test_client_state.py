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
