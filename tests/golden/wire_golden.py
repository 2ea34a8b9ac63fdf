"""Generator of the wire format's golden byte vectors (tests/golden/wire_v1.json).

The cases are built from explicit lists (no random generator whose stream could change between
torch versions). Each JSON entry holds the encoder's argument, the exact message as hex, and the
decoded content (names, shapes, codings, indices, raw value bits) so that a codec in another
language (the Java one of android_bridge) can test both directions without Python.

Regenerate only on a deliberate format change (bump the version in dgc/wire/layout.py first)::

    PYTHONPATH=. python tests/golden/wire_golden.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

GOLDEN_PATH = Path(__file__).with_name("wire_v1.json")

_RAW_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _tensor(indices: list[int], values: list[float], shape: tuple[int, ...],
            dtype: torch.dtype):
    from dgc import SparseTensor

    return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                        torch.tensor(values, dtype=torch.float32).to(dtype), shape)


def golden_cases() -> list[tuple[str, object, str]]:
    """``(case name, SparseUpdate, index_coding)`` for every golden vector, in file order."""
    from dgc import SparseUpdate

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    spread = [0, 3, 4, 17, 31, 100, 101, 250, 255]  # gaps 0..149, a mix of quotients
    spread_values = [0.5, -1.25, 3.0, -0.0, 1e-3, 65504.0, -2.0, 0.1, 7.75]
    return [
        ("empty_update", SparseUpdate({}, 0), "auto"),
        ("golomb_fp16", SparseUpdate({"fc.weight": _tensor(spread, spread_values, (16, 16), f16)},
                                     1), "golomb"),
        ("raw_fp32", SparseUpdate({"fc.weight": _tensor(spread, spread_values, (16, 16), f32)},
                                  2), "raw"),
        ("bitmap_bf16", SparseUpdate({"fc.weight": _tensor(spread, spread_values, (16, 16),
                                                           bf16)}, 3), "bitmap"),
        ("all_dense_bias", SparseUpdate({"fc.bias": _tensor([0, 1, 2, 3], [1.0, -1.0, 0.5, 0.0],
                                                            (4,), f32)}, 4), "auto"),
        ("edges", SparseUpdate({
            "scalar": _tensor([0], [2.5], (), f16),
            "empty.tensor": _tensor([], [], (3, 0), f16),
            "no.selection": _tensor([], [], (5, 5), bf16),
            "first.and.last": _tensor([0, 999], [1.0, -1.0], (10, 100), f16),
            "层.权重": _tensor([7], [0.25], (8,), f32),
        }, 2**64 - 1), "auto"),
        ("auto_mixed", SparseUpdate({
            "conv1.weight": _tensor(list(range(0, 432, 3)), [0.01 * i for i in range(144)],
                                    (16, 3, 3, 3), f16),   # density 1/3: bitmap wins
            "layer1.weight": _tensor([5, 700, 1402, 3000], [1.0, 2.0, -3.0, 4.0],
                                     (64, 64), bf16),      # density 0.001: Golomb-Rice wins
            "tiny.weight": _tensor([1], [9.0], (2, 2), f32),
        }, 12345), "auto"),
    ]


def case_record(case: str, update, index_coding: str) -> dict:
    """The JSON entry of one case: argument, message hex, and the decoded content."""
    from dgc import decode, encode
    from dgc.wire import MAX_NUMEL, tensor_codings

    data = encode(update, index_coding)
    decoded = decode(data, max_numel=MAX_NUMEL)
    codings = tensor_codings(data)
    tensors = []
    for name, t in decoded.tensors.items():
        tensors.append({
            "name": name,
            "shape": list(t.shape),
            "dtype": _DTYPE_NAMES[t.values.dtype],
            "index_coding": codings[name],
            "indices": t.indices.tolist(),
            "value_bits": [int(v) & (2 ** (8 * t.values.element_size()) - 1)
                           for v in t.values.view(_RAW_VIEW[t.values.dtype]).tolist()],
        })
    return {"case": case, "index_coding_argument": index_coding, "sequence": decoded.sequence,
            "bytes": len(data), "hex": data.hex(), "tensors": tensors}


def golden_records() -> list[dict]:
    """Every golden entry as it would be written now."""
    return [case_record(*case) for case in golden_cases()]


def write_golden(path: Path = GOLDEN_PATH) -> None:
    """Write the golden file (only on a deliberate format change)."""
    payload = {"format": "fedgc sparse update, wire version 1", "spec": "docs/wire.md",
               "cases": golden_records()}
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_PATH)
    print(f"wrote {GOLDEN_PATH}", file=sys.stderr)
