"""Tests of the image dataset loaders: shipped data, and standard-format files written here."""

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import DATASETS, DataError, get_task
from tasks.images import CIFAR10_FILES, FASHION_MNIST_DIR, MNIST_FILES, read_idx


def test_defaults_per_dataset() -> None:
    assert DATASETS == {
        "mnist5k": "mlp",
        "digits": "mlp",
        "fashion-mnist": "cnn",
        "shakespeare": "lstm",
        "mnist": "mlp",
        "cifar10": "cnn",
    }


def test_mnist5k_stratified_split_scaled_and_seeded() -> None:
    task = get_task("mnist5k", seed=0)
    assert (task.name, task.num_classes, task.input_shape) == ("mnist5k", 10, (784,))
    assert task.train_x.dtype == torch.float32 and task.train_y.dtype == torch.int64
    assert task.train_x.shape == (4000, 784) and task.test_x.shape == (1000, 784)
    assert float(task.train_x.min()) == 0.0 and float(task.train_x.max()) == 1.0
    assert torch.bincount(task.test_y).tolist() == [100] * 10
    assert task.natural_clients is None
    again, other = get_task("mnist5k", seed=0), get_task("mnist5k", seed=1)
    assert torch.equal(task.test_x, again.test_x)
    assert not torch.equal(task.test_x, other.test_x)
    # The shipped file is sorted by class; the split must not keep that order.
    assert torch.unique(task.train_y[:100]).numel() == 10
    # Train and test are disjoint images (compare by exact pixel rows).
    train_rows = {row.tobytes() for row in task.train_x.numpy()}
    assert sum(row.tobytes() in train_rows for row in task.test_x.numpy()) < 10


def test_mnist5k_cnn_layout_and_independent_tensors() -> None:
    task = get_task("mnist5k", model="cnn")
    assert task.input_shape == (1, 28, 28) and task.model_name == "cnn"
    task.train_x.zero_()  # must not corrupt the cache behind the next get_task
    assert float(get_task("mnist5k", model="cnn").train_x.max()) == 1.0


def test_digits() -> None:
    task = get_task("digits", test_fraction=0.25)
    assert task.input_shape == (64,) and len(task.train_y) + len(task.test_y) == 1797
    assert abs(len(task.test_y) - 0.25 * 1797) < 10
    assert float(task.train_x.max()) == 1.0
    with pytest.raises(DataError, match=r"test_fraction must be in \(0, 1\), got 1.5"):
        get_task("digits", test_fraction=1.5)


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    codes = {np.dtype("u1"): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + array.tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


def _write_mnist(folder: Path, compress: bool, n_train: int = 30, n_test: int = 10) -> tuple:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train).astype(np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test).astype(np.uint8),
    )
    for stem, array in zip(MNIST_FILES, arrays, strict=True):
        _write_idx(folder / (stem + (".gz" if compress else "")), array, compress)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
def test_mnist_from_idx_files(tmp_path: Path, compress: bool) -> None:
    train_x, train_y, test_x, test_y = _write_mnist(tmp_path, compress)
    task = get_task("mnist", data_dir=tmp_path)
    assert task.input_shape == (784,)
    assert torch.allclose(task.train_x, torch.from_numpy(train_x.reshape(30, -1) / 255.0).float())
    assert task.train_y.tolist() == train_y.tolist() and task.test_y.tolist() == test_y.tolist()
    assert torch.equal(
        get_task("mnist", model="cnn", data_dir=tmp_path).test_x[:, 0] * 255,
        torch.from_numpy(test_x).float(),
    )


def test_mnist_torchvision_layout(tmp_path: Path) -> None:
    _write_mnist(tmp_path / "MNIST" / "raw", compress=True)
    assert len(get_task("mnist", data_dir=tmp_path).train_y) == 30


def test_mnist_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="mnist needs data_dir"):
        get_task("mnist")
    _write_mnist(tmp_path, compress=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(
        DataError, match=rf"missing t10k-labels-idx1-ubyte\[.gz\] in folder {tmp_path}"
    ):
        get_task("mnist", data_dir=tmp_path)


def test_fashion_mnist_missing_files_say_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist") as err:
        get_task("fashion-mnist", data_dir=tmp_path)
    assert "train-images-idx3-ubyte" in str(err.value) and str(tmp_path) in str(err.value)


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_full() -> None:
    task = get_task("fashion-mnist")
    assert task.model_name == "cnn" and task.input_shape == (1, 28, 28)
    assert (len(task.train_y), len(task.test_y)) == (60000, 10000)
    assert torch.bincount(task.test_y).tolist() == [1000] * 10
    assert float(task.test_x.max()) == 1.0


def test_read_idx_rejects_corrupt_files(tmp_path: Path) -> None:
    good = np.arange(12, dtype=">i4").reshape(3, 4)
    _write_idx(tmp_path / "ok", good, compress=False)
    assert read_idx(tmp_path / "ok").tolist() == good.tolist()
    (tmp_path / "bad_magic").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataError, match="not an idx file"):
        read_idx(tmp_path / "bad_magic")
    (tmp_path / "short").write_bytes((tmp_path / "ok").read_bytes()[:-4])
    with pytest.raises(DataError, match=r"shape \(3, 4\) \(60 bytes\) but the file has 56 bytes"):
        read_idx(tmp_path / "short")
    (tmp_path / "gz").write_bytes(gzip.compress(b"x" * 100)[:20])
    with pytest.raises(DataError, match="not an idx file"):
        read_idx(tmp_path / "gz")
    whole = gzip.compress((tmp_path / "ok").read_bytes())
    (tmp_path / "gz").write_bytes(whole[:-12])
    with pytest.raises(DataError, match="truncated or corrupt gzip"):
        read_idx(tmp_path / "gz")
    (tmp_path / "gz").write_bytes(whole[:12] + bytes(b ^ 0xFF for b in whole[12:-8])
                                  + whole[-8:])
    with pytest.raises(DataError, match="corrupt gzip"):
        read_idx(tmp_path / "gz")


def _write_cifar(folder: Path, n_per_batch: int = 4, protocol: int = 2) -> list[dict]:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True)
    batches = []
    for name in CIFAR10_FILES:
        batch = {
            b"batch_label": name.encode(),
            b"labels": rng.integers(0, 10, n_per_batch).tolist(),
            b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
            b"filenames": [b"img%d.png" % i for i in range(n_per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))
        batches.append(batch)
    return batches


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_from_python_batches(tmp_path: Path, protocol: int) -> None:
    batches = _write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    task = get_task("cifar10", data_dir=tmp_path)
    assert task.model_name == "cnn" and task.input_shape == (3, 32, 32)
    assert len(task.train_y) == 20 and len(task.test_y) == 4
    assert task.train_y.tolist() == sum((b[b"labels"] for b in batches[:5]), [])
    first = batches[0][b"data"][0].reshape(3, 32, 32) / 255.0
    assert torch.allclose(task.train_x[0], torch.from_numpy(first).float())
    model = task.build_model()
    assert model(task.test_x).shape == (4, 10)


def test_cifar10_missing_and_malicious_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cifar10 needs data_dir"):
        get_task("cifar10")
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"missing data_batch_3 in folder .*cifar-10-batches-py"):
        get_task("cifar10", data_dir=tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DataError, match=r"print is not allowed in a CIFAR batch"):
        get_task("cifar10", data_dir=tmp_path)
    (folder / "data_batch_3").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    )
    with pytest.raises(DataError, match=r"data_batch_3: data of shape \(2, 100\)"):
        get_task("cifar10", data_dir=tmp_path)


# ------------------------------------------------------------------ bounded loaders (issue 35)

#: Checks each crafted file in a process that may allocate at most 512 MB more than it holds
#: after its imports: a loader that sized an allocation from a header would fail there with a
#: MemoryError (or worse), where a bounded one refuses the file in one line.
BOUNDED = """
import resource, sys, traceback
from pathlib import Path
from tasks import get_task
from tasks.errors import DataError
from tasks.images import read_idx
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
for kind, path in (line.split(" ", 1) for line in sys.stdin.read().splitlines()):
    try:
        if kind == "idx":
            read_idx(Path(path))
        else:
            get_task(kind, data_dir=path)
        print("LOADED", path)
    except DataError as ex:
        print("REFUSED", str(ex).replace(chr(10), " "))
    except BaseException as ex:
        print("CRASHED", type(ex).__name__, str(ex)[:200].replace(chr(10), " "))
"""


def _loaded_in_bounds(cases: list[tuple[str, Path]]) -> list[str]:
    """What a bounded process said of each of ``cases`` ((kind, path): "idx" or a task)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BOUNDED], capture_output=True, text=True,
                          input="".join(f"{k} {p}\n" for k, p in cases), timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def _pickle_ops(*ops: bytes) -> bytes:
    return b"\x80\x02}U\x04data" + b"".join(ops) + b"s."


def test_crafted_cifar_batches_are_refused_without_allocating(tmp_path: Path) -> None:
    """Issue 35: a 73-byte batch made the loader allocate 4.3 GB (``bytearray`` was on the
    unpickler's allow-list and took a size); a pickle's declared lengths and ``ndarray`` are
    sizes too. Each is now one DataError, inside 512 MB, and a FIFO is not waited on."""
    import os

    huge = (4_300_000_000).to_bytes(5, "little")
    crafted = {
        "bytearray_of_a_size": _pickle_ops(b"cbuiltins\nbytearray\n\x8a\x05", huge,
                                           b"\x85R"),
        "ndarray_of_a_shape": _pickle_ops(b"cnumpy\nndarray\n\x8a\x05", huge, b"\x85\x85R"),
        "bytes8_of_8gb": b"\x80\x04\x8e" + (2**33).to_bytes(8, "little") + b"abc",
        "object_array": pickle.dumps({b"data": np.array([None] * 3, dtype=object),
                                      b"labels": [0, 1, 2]}, protocol=2),
    }
    assert len(crafted["bytearray_of_a_size"]) < 73
    cases = []
    for name, data in crafted.items():
        folder = tmp_path / name / "cifar-10-batches-py"
        _write_cifar(folder)
        (folder / "data_batch_2").write_bytes(data)
        cases.append(("cifar10", tmp_path / name))
    fifo = tmp_path / "fifo" / "cifar-10-batches-py"
    _write_cifar(fifo)
    (fifo / "test_batch").unlink()
    os.mkfifo(fifo / "test_batch")
    cases.append(("cifar10", tmp_path / "fifo"))
    said = _loaded_in_bounds(cases)
    assert all(line.startswith("REFUSED") for line in said), said
    assert "bytearray of a int is not allowed" in said[0]
    assert "an array is rebuilt only empty" in said[1] or "takes no arguments" in said[1]
    assert "expected 8589934592 bytes" in said[2]
    assert "dtype object is not numeric" in said[3]
    assert "cifar10: missing test_batch" in said[4]  # not a regular file: not waited on


def test_crafted_idx_files_are_refused_without_allocating(tmp_path: Path) -> None:
    """Issue 35: a 26 MB gzip idx file ended in a 19-frame MemoryError traceback. An idx file is
    now inflated to the size its header declares and no further, a header declaring more than
    an idx file may hold is refused before anything is inflated, and so is a file that large."""
    header = bytes([0, 0, 0x08, 2]) + np.asarray([10, 10], dtype=">u4").tobytes()
    (tmp_path / "bomb.gz").write_bytes(gzip.compress(header + bytes(300 << 20),
                                                     compresslevel=1))
    claims = bytes([0, 0, 0x08, 3]) + np.asarray([60000, 60000, 60000], dtype=">u4").tobytes()
    (tmp_path / "claims.gz").write_bytes(gzip.compress(claims + bytes(100)))
    (tmp_path / "claims").write_bytes(claims + bytes(100))
    with (tmp_path / "sparse").open("wb") as fh:
        fh.truncate(3 << 30)  # 3 GB that take no disk
    said = _loaded_in_bounds([("idx", tmp_path / n) for n in
                              ("bomb.gz", "claims.gz", "claims", "sparse")])
    assert all(line.startswith("REFUSED") for line in said), said
    assert "inflates to more than the 112 bytes its header says" in said[0]
    assert "header says shape (60000, 60000, 60000)" in said[1] and "more than an idx" in said[1]
    assert "header says shape (60000, 60000, 60000)" in said[2]
    assert f"{3 << 30} bytes, more than an idx file may hold" in said[3]


def test_a_shakespeare_folder_is_read_within_bounds(tmp_path: Path) -> None:
    import os

    from tasks.shakespeare import MAX_TEXT_BYTES, load_roles

    os.mkfifo(tmp_path / "hamlet_gut.txt")  # reading it would wait for a writer for ever
    with pytest.raises(DataError, match="a play's text must be a regular file"):
        load_roles(tmp_path)
    (tmp_path / "hamlet_gut.txt").unlink()
    with (tmp_path / "hamlet_gut.txt").open("wb") as fh:
        fh.truncate(MAX_TEXT_BYTES + 1)
    with pytest.raises(DataError, match="more than a play's text may hold"):
        load_roles(tmp_path)
