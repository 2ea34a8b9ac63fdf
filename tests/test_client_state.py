"""ClientStateStore: records round-trip, writes are atomic, bad keys and damaged files fail."""

import pytest
import torch

from client.state import ClientStateStore, StateStoreError
from fedgc.ownership import MANIFEST


def test_round_trip_and_replace(tmp_path):
    store = ClientStateStore(tmp_path / "s")
    assert store.get("7") is None
    store.put("7", {"v": torch.arange(5.0), "version": 3})
    store.put("7", {"v": torch.ones(2), "version": 4})
    got = store.get("7")
    assert got["version"] == 4 and torch.equal(got["v"], torch.ones(2))
    assert store.keys() == ["7"]
    # No temporary files are left behind by the atomic writes; the manifest lists the record.
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [MANIFEST, "7.state"]
    assert (tmp_path / "s" / MANIFEST).read_text() == "7.state\n"  # once: created once
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
    from fedgc.settings import RunConfig

    config = RunConfig.from_flat({
        "density": 0.01, "dgc.small_density": small_density, "dgc.warmup": "none",
        "dgc.selection": "exact", "dgc.min_sparse_numel": 100, "run_name": "t"})
    method, settings = config.method, config.train
    kept = method.compressor(settings, 0)
    assert type(kept).__name__ == ("DGCCompressor" if small_density == 0 else
                                   "TwoDensityCompressor")
    pending = kept.compress(_grads(0), sequence=1)
    store = ClientStateStore(tmp_path)
    store.put("3", {"compressor": kept.state_dict()})
    loaded = method.compressor(settings, 0)
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


# ----------------------------------------------------------------------------- the record format
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def _rich_record() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "compressor": {"two_density": True, "shapes": {"w": [30, 40]},
                       "large": {"version": 1, "step": 7,
                                 "config": {"clip_norm": None, "lr": 0.1, "inf": float("inf"),
                                            "nan": float("nan"), "warmup": "exponential",
                                            "pair": (1, 2.5), "flag": True},
                                 "memory": {"u": {}, "v": {"w": torch.randn(1200, generator=g),
                                                           "b": torch.randn(30, generator=g)}}}},
        "pending": torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g),
        "model": {"w": torch.randn(30, 40, generator=g).t(),  # not contiguous
                  "half": torch.randn(5, generator=g).half(),
                  "bf16": torch.randn(3, generator=g).bfloat16(),
                  "f64": torch.tensor(2.5, dtype=torch.float64),  # 0-dim
                  "i64": torch.arange(-3, 3), "i32": torch.arange(4, dtype=torch.int32),
                  "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 7)},
        "model_version": 3, "reply": {"num-examples": 6, "density": 0.001, "client_key": 12},
        "list": [1, "two", None, [3.0]], "big": 2**70, "text": "é",
    }


def test_record_round_trips_exactly(tmp_path):
    store = ClientStateStore(tmp_path)
    record = _rich_record()
    store.put("12", record)
    got = store.get("12")
    assert _same(record, got)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != MANIFEST) == ["12.state"]
    # The tensors read back are ordinary, writable tensors.
    got["compressor"]["large"]["memory"]["v"]["w"].add_(1.0)
    assert torch.equal(store.get("12")["compressor"]["large"]["memory"]["v"]["w"],
                       record["compressor"]["large"]["memory"]["v"]["w"])


def test_a_client_record_continues_the_compressor_bit_for_bit(tmp_path):
    """The record client.app writes (compressor state + pending bytes) survives unchanged."""
    import dgc
    from fedgc.settings import RunConfig

    config = RunConfig.from_flat({
        "density": 0.01, "dgc.small_density": 0.1, "dgc.warmup": "none",
        "dgc.selection": "exact", "dgc.min_sparse_numel": 100, "run_name": "t"})
    method, settings = config.method, config.train
    c = method.compressor(settings, 0)
    update = c.compress(_grads(0), sequence=1)
    store = ClientStateStore(tmp_path)
    data = dgc.encode(update)
    store.put("4", {"compressor": c.state_dict(),
                    "pending": torch.frombuffer(bytearray(data), dtype=torch.uint8)})
    record = store.get("4")
    assert bytes(record["pending"].numpy().tobytes()) == data
    loaded = method.compressor(settings, 0)
    loaded.load_state_dict(record["compressor"])
    assert dgc.encode(loaded.compress(_grads(1), sequence=2)) == \
        dgc.encode(c.compress(_grads(1), sequence=2))


@pytest.mark.parametrize("damage", ["truncate", "truncate_header", "flip_data", "flip_header",
                                    "append", "magic", "empty"])
def test_damaged_record_is_a_specific_error_and_nothing_else_is_lost(tmp_path, damage):
    store = ClientStateStore(tmp_path)
    store.put("1", _rich_record())
    store.put("2", _rich_record())
    path = tmp_path / "2.state"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    elif damage == "truncate_header":
        data = data[:10]
    elif damage == "flip_data":
        data[len(data) // 2] ^= 0x10
    elif damage == "flip_header":
        data[30] ^= 0x01
    elif damage == "append":
        data += b"\0"
    elif damage == "magic":
        data[:4] = b"PK\x03\x04"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    expected = {"truncate": "truncated", "truncate_header": "truncated", "flip_data": "CRC32",
                "flip_header": "CRC32|truncated|too long", "append": "too long",
                "magic": "not a client state record", "empty": "truncated"}[damage]
    with pytest.raises(StateStoreError, match=expected) as err:
        store.get("2")
    assert "2.state" in str(err.value)
    assert _same(store.get("1"), _rich_record())
    # A new write replaces the damaged record.
    store.put("2", {"v": torch.ones(2)})
    assert torch.equal(store.get("2")["v"], torch.ones(2))


@pytest.mark.parametrize("bad", [{"x": object()}, {1: torch.ones(1)}, {"$t": 0},
                                 {"x": torch.ones(2, dtype=torch.complex64)}, {"x": b"raw"}])
def test_unstorable_record_is_refused_and_the_old_one_kept(tmp_path, bad):
    store = ClientStateStore(tmp_path)
    store.put("5", {"v": torch.zeros(3)})
    with pytest.raises(StateStoreError, match="cannot store"):
        store.put("5", bad)
    assert torch.equal(store.get("5")["v"], torch.zeros(3))
    # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != MANIFEST) == ["5.state"]


def test_a_failed_write_leaves_the_old_record_and_no_temporary_file(tmp_path, monkeypatch):
    store = ClientStateStore(tmp_path)
    store.put("6", {"v": torch.zeros(3)})

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("fedgc.files.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        store.put("6", {"v": torch.ones(3)})
    monkeypatch.undo()
    assert torch.equal(store.get("6")["v"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != MANIFEST) == ["6.state"]


def test_legacy_torch_save_records_are_read_and_replaced(tmp_path):
    """A folder written by an earlier version (``<key>.pt``) is read; the next write moves the
    record to the current format."""
    torch.save({"v": torch.arange(4.0), "version": 2}, tmp_path / "9.pt")
    store = ClientStateStore(tmp_path)
    assert store.keys() == ["9"]
    assert torch.equal(store.get("9")["v"], torch.arange(4.0))
    store.put("9", {"v": torch.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != MANIFEST) == ["9.state"]
    assert torch.equal(store.get("9")["v"], torch.ones(1))
    store.delete("9")
    assert store.keys() == [] and store.get("9") is None
