"""Golden byte vectors of every payload kind a registered method declares
(tests/golden/payloads/<kind>.json).

Each kind's codec names its cases (:meth:`fedgc.methods.Codec.golden_cases`, built from explicit
lists); each JSON entry holds the exact message as hex and the decoded content (per part: names,
shapes, value dtypes, indices, raw value bits) so that a codec in another language can test both
directions. The codec of a kind is that of the first registered method that declares it.

Regenerate only on a deliberate format change (bump the kind's version first), or when adding a
kind::

    PYTHONPATH=. python tests/golden/payload_golden.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

GOLDEN_DIR = Path(__file__).with_name("payloads")

_RAW_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_MASKS = {torch.float32: 0xFFFFFFFF, torch.float16: 0xFFFF, torch.bfloat16: 0xFFFF}


def codec_of(method: Any) -> Any:
    """``method``'s codec in a run of it with every key at its default."""
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": method.name, "run_name": "golden"})
    return run.method.codec(run.train)


def codecs() -> dict[str, Any]:
    """Every payload kind of the registered methods and its codec (the first method's)."""
    from fedgc import methods

    out: dict[str, Any] = {}
    for m in methods.registered():
        codec = codec_of(m)
        out.setdefault(codec.kind, codec)
    return out


def content(payload: Any) -> list[list[dict]]:
    """The decoded content of a payload: per part, its tensors in message order."""
    parts = []
    for part in payload.parts():
        tensors = []
        for name, t in part.tensors.items():
            bits = t.values.contiguous().view(_RAW_VIEW[t.values.dtype]).to(torch.int64)
            tensors.append({"name": name, "shape": list(t.shape),
                            "dtype": str(t.values.dtype).removeprefix("torch."),
                            "indices": t.indices.tolist(),
                            "value_bits": [int(b) & _MASKS[t.values.dtype] for b in bits]})
        parts.append(tensors)
    return parts


def records(kind: str, codec: Any) -> dict:
    """The JSON document of one kind."""
    cases = []
    for case, payload in codec.golden_cases():
        data = codec.encode(payload)
        decoded = codec.decode(data, codec.golden_bound(case))
        cases.append({"case": case, "sequence": decoded.sequence, "bytes": len(data),
                      "hex": data.hex(), "parts": content(decoded)})
    return {"kind": kind, "spec": "docs/wire.md", "cases": cases}


def main() -> int:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for kind, codec in codecs().items():
        doc = records(kind, codec)
        (GOLDEN_DIR / f"{kind}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False)
                                                 + "\n")
        print(f"{kind}: {len(doc['cases'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
