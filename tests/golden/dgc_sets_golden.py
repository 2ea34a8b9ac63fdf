"""Generator of the golden vectors of dgc_sets' phone-side host steps (tests/golden/dgc_sets.json).

What a phone computes beside its exported programs under ``dgc_sets`` (docs/android.md, "What
dgc_sets needs on a phone"), as the Python side computes it, for the Java codec's driver
(``org.fedgc.wire.DgcSetsTest``) to check without Python:

- ``rank_requests``: rank request bytes (``dgc.signs.codec.encode_rank_request``) and what they
  decode to;
- ``rankings``: a tensor held and its version 0, the full order by displacement
  (``dgc.ranking.ranked``) and the sets of given sizes (``displacement_masks``);
- ``exponents``: ``on_grid``'s step exponent for a mean and a level count, some of them means
  whose ``log2(mean / levels)`` rounds to exactly half an integer (round half to even);
- ``on_grid``: values and levels, the values on the grid (``dgc.signs.client.on_grid``);
- ``grid_updates``: updates and their grid-coded bytes (``dgc.encode(..., grid_coding=True)``);
- ``take_values``: a residual, a set and levels, what is sent, the residual left and the bytes
  (``take_values``, ``encode_values``);
- ``sets_first``: a pseudo-gradient, a residual and sets, what the reference phone's
  ``encoder_round`` hands its encoder, sends at the sets and restores after the top-k
  (``dgc.shared_first``), with an encoder that has compressed and one that has not;
- ``context_patches``: a held model, its version 0, a patch ranked by displacement
  (``downlink_context``) and the model it makes (``fedgc.patching.apply_patch``), or the
  refusal of a patch that does not fit.

Values come from explicit formulas (no random generator whose stream could change). Regenerate
only when adding cases::

    PYTHONPATH=. python tests/golden/dgc_sets_golden.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

GOLDEN_PATH = Path(__file__).with_name("dgc_sets.json")


def bits(values: torch.Tensor | np.ndarray) -> list[int]:
    """float32 values as their raw bits (unsigned)."""
    a = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    return [int(b) for b in a.view(np.uint32).reshape(-1)]


def floats(n: int, mul: int, mod: int, scale: float, offset: float = 0.0) -> np.ndarray:
    """``n`` deterministic float32 values spread over [-scale/2, scale/2) (+ offset)."""
    i = np.arange(n, dtype=np.int64)
    return ((((i * mul) % mod) / mod - 0.5) * scale + offset).astype(np.float32)


def rank_requests() -> list[dict]:
    from dgc.signs.codec import decode_rank_request, encode_rank_request

    numels = {"conv.weight": 432, "fc.weight": 2560, "层.b": 10}
    cases = [
        ("plain", {"conv.weight": 40, "fc.weight": 25}, False, None, 3),
        ("on_grid_all", {"conv.weight": 432, "fc.weight": 1, "层.b": 10}, True, None, 2**64 - 1),
        ("explore", {"conv.weight": 40, "fc.weight": 25}, False, {"conv.weight": 4}, 9),
        ("empty", {}, False, None, 0),
    ]
    out = []
    for case, counts, grid, explore, sequence in cases:
        data = encode_rank_request(counts, numels, sequence, grid, explore)
        seq, got, on_grid, drawn = decode_rank_request(data, numels)
        out.append({"case": case, "hex": data.hex(), "numels": numels, "sequence": seq,
                    "counts": got, "initial_on_grid": on_grid,
                    "explore": {n: drawn.get(n, 0) for n in got} if drawn else {}})
    return out


def rankings() -> list[dict]:
    from dgc.ranking import ranked
    from dgc.signs.planner import displacement_masks

    origin = floats(300, 37, 101, 0.2)
    moved = origin.copy()
    moved[::3] += floats(100, 13, 29, 0.05)  # two thirds never moved: ties at zero
    moved[5] = moved[7] = origin[5] + np.float32(0.5)  # equal magnitudes, one either way
    moved[7] = origin[7] - np.float32(0.5)
    ties = np.zeros(64, dtype=np.float32)
    ties[[3, 9, 40, 41]] = 1.0  # four equal, the rest all zero
    grid = np.round(origin / np.float32(2.0**-6)) * np.float32(2.0**-6)  # int8-grid version 0
    signed = np.array([0.0, -0.0, 1.0, -1.0, 0.25, -0.25, 3e-39, -3e-39], dtype=np.float32)
    cases = [("moved", moved, origin, [1, 7, 60, 100, 101, 300]),
             ("ties", ties, np.zeros(64, dtype=np.float32), [1, 2, 4, 5, 64]),
             ("from_grid", moved, grid.astype(np.float32), [1, 30, 299]),
             ("signed_zeros_subnormals", signed, np.zeros(8, dtype=np.float32), [1, 3, 6, 8])]
    out = []
    for case, model, initial, counts in cases:
        m, o = torch.from_numpy(model), torch.from_numpy(initial)
        sets = [displacement_masks({"t": m}, {"t": o}, {"t": k})["t"].tolist() for k in counts]
        out.append({"case": case, "model_bits": bits(model), "initial_bits": bits(initial),
                    "order": ranked(m, o).tolist(), "counts": counts, "sets": sets})
    return out


def _exponent(mean: float, levels: float) -> int:
    """``on_grid``'s exponent, as it computes it."""
    return min(max(round(math.log2(mean / levels)), -126), 120)


def exponents() -> list[dict]:
    """Means and levels with the exponent Python rounds to, among them means whose
    ``log2(mean / levels)`` is exactly half an integer after rounding (ties to even)."""
    picks: list[tuple[float, float]] = []
    for n in range(-40, 30, 3):
        r = math.sqrt(2.0) * 2.0**n  # log2(r) = n + 0.5: a double r where it rounds to that
        for _ in range(40):
            if math.log2(r) == n + 0.5:
                break
            r = math.nextafter(r, math.inf)
        else:
            continue
        mean = float(np.float32(0.3 * 2.0**n))  # a float32 mean, and levels that hit r
        levels = mean / r
        for _ in range(8):
            if mean / levels == r:
                picks.append((mean, levels))
                break
            levels = math.nextafter(levels, math.inf if mean / levels > r else -math.inf)
        # and its neighbours, whose log2 is not half an integer
        picks.append((float(np.nextafter(np.float32(mean), np.float32(np.inf))), levels))
    ties = sum(math.log2(m / lv) % 1 == 0.5 for m, lv in picks)
    picks += [(1e-45, 1.0), (3.4e38, 0.5), (1.0, 1.0), (0.75, 0.5), (2.0**-130, 4.0),
              (6.0, 3.0), (1e-3, 0.5), (0.0123, 4.0)]
    assert ties > 0, "no mean found whose log2 rounds to half an integer"
    return [{"mean_bits": bits(np.array([m]))[0], "levels": lv, "exponent": _exponent(
        float(np.float32(m)), lv)} for m, lv in picks]


def on_grid_cases() -> list[dict]:
    from dgc.signs.client import on_grid

    cases = [
        ("spread", floats(200, 31, 97, 0.02), 0.5),
        ("fine", floats(200, 31, 97, 0.02), 4.0),
        ("clipped", np.concatenate([np.full(50, 1e-4, np.float32),
                                    np.array([1.0, -1.0], np.float32)]), 1.0),
        ("halves", np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 0.0], np.float32), 1.0 / 1.5),
        ("zeros", np.zeros(5, np.float32), 0.5),
        ("negative_zero", np.array([-0.0, -1e-9, 1.0], np.float32), 0.5),
        ("one", np.array([-0.3], np.float32), 0.5),
        ("empty", np.zeros(0, np.float32), 0.5),
    ]
    return [{"case": c, "levels": lv, "value_bits": bits(v),
             "grid_bits": bits(on_grid(torch.from_numpy(v.copy()), lv))} for c, v, lv in cases]


def _tensor_json(name: str, t) -> dict:
    return {"name": name, "shape": list(t.shape), "dtype": str(t.values.dtype).removeprefix(
        "torch."), "indices": t.indices.tolist(), "value_bits": [
            int(b) & (0xFFFFFFFF if t.values.dtype == torch.float32 else 0xFFFF)
            for b in t.values.contiguous().view(torch.int32 if t.values.dtype == torch.float32
                                                else torch.int16).tolist()]}


def grid_updates() -> list[dict]:
    import dgc
    from dgc import SparseTensor, SparseUpdate
    from dgc.signs.client import values_on_grid

    def t(indices, values, shape, dtype=torch.float32):
        return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                            torch.as_tensor(np.asarray(values, np.float32)).to(dtype), shape)

    idx = list(range(0, 1000, 7))
    spread = floats(len(idx), 41, 113, 0.4)
    top = SparseUpdate({"fc.weight": t(idx, spread, (10, 100)),
                        "fc.bias": t(list(range(10)), floats(10, 3, 7, 1.0), (10,))}, 5)
    levels_4, _ = values_on_grid(top, 4.0)
    levels_half, _ = values_on_grid(top, 0.5)
    q = (np.arange(-127, 128, dtype=np.float32))
    cases = [
        ("values_on_grid_4", levels_4),
        ("values_on_grid_half", levels_half),  # mostly 0 and +-1 steps: Rice-coded
        ("byte_per_value", SparseUpdate({"w": t(list(range(255)), q * np.float32(2.0**-9),
                                                 (255,))}, 1)),
        ("coarsened", SparseUpdate({"w": t([1, 4, 6], [4.0, -8.0, 12.0], (8,))}, 2)),
        ("lowest_exponent", SparseUpdate({"w": t([0, 1, 2], np.array([1, -3, 0], np.float32)
                                                 * np.float32(2.0**-126), (3,))}, 3)),
        ("highest_exponent", SparseUpdate({"w": t([0, 1], [2.0**120 * 64, -2.0**126], (2,))},
                                          4)),
        ("off_grid_and_others", SparseUpdate({
            "off": t([0, 1, 2], [0.1, 0.2, 0.3], (3,)),
            "negative_zero": t([0, 1], [-0.0, 1.0], (2,)),
            "single": t([3], [0.5], (4,)),
            "half": t([0, 1], [0.5, 1.0], (2,), torch.float16),
            "beyond_exponent": t([0, 1], [2.0**-140, 2.0**-139], (2,)),
            "empty": t([], [], (0,)),
            "zeros": t([0, 1], [0.0, 0.0], (2,))}, 2**64 - 1)),
    ]
    out = []
    for case, update in cases:
        data = dgc.encode(update, grid_coding=True)
        out.append({"case": case, "sequence": update.sequence, "hex": data.hex(),
                    "tensors": [_tensor_json(n, x) for n, x in update.tensors.items()]})
    return out


def take_values_cases() -> list[dict]:
    from dgc.signs.client import take_values
    from dgc.signs.codec import encode_values

    out = []
    for case, levels, residual, sets in [
            ("two_tensors", 0.5, {"a": floats(120, 17, 61, 0.1), "b": floats(40, 7, 13, 2.0)},
             {"a": list(range(0, 120, 5)), "b": [0, 3, 39]}),
            ("fine", 4.0, {"a": floats(120, 17, 61, 0.1)}, {"a": list(range(1, 120, 2))}),
            ("one_entry", 0.5, {"a": floats(9, 5, 7, 1.0)}, {"a": [4]})]:
        torch_residual = {n: torch.from_numpy(v.copy()) for n, v in residual.items()}
        masks = {n: np.asarray(s, dtype=np.int64) for n, s in sets.items()}
        sent = take_values(torch_residual, masks, 11, levels)
        out.append({"case": case, "levels": levels, "sequence": 11,
                    "residual_bits": {n: bits(v) for n, v in residual.items()}, "sets": sets,
                    "sent_bits": {n: bits(t.values) for n, t in sent.tensors.items()},
                    "left_bits": {n: bits(v) for n, v in torch_residual.items()},
                    "hex": encode_values(sent).hex()})
    return out


class _RecordingEncoder:
    """What ``encoder_round`` asks of an encoder, recording what it is handed: no top-k."""

    def __init__(self, residual: dict[str, np.ndarray]) -> None:
        self.state = {n: torch.from_numpy(v.copy()) for n, v in residual.items()}
        self.compressed: dict[str, np.ndarray] = {}
        self.restored: dict[str, tuple[list[int], list[int]]] = {}

    def residual(self) -> dict[str, torch.Tensor]:
        return self.state

    def compress(self, grads, epoch: float, sequence: int):
        from dgc import SparseUpdate

        self.compressed = {n: np.asarray(g, dtype=np.float32).copy() for n, g in grads.items()}
        return SparseUpdate({}, sequence)

    def restore(self, update) -> None:
        for name, t in update.tensors.items():
            self.restored[name] = (t.indices.tolist(), bits(t.values))
            self.state[name].index_add_(0, t.indices, t.values.to(torch.float32))


def sets_first_cases() -> list[dict]:
    from android_bridge.phone import encoder_round

    grads = {"a": floats(120, 17, 61, 0.1), "b": floats(40, 7, 13, 2.0),
             "c": floats(10, 3, 7, 1.0)}  # c: no set
    residual = {"a": floats(120, 11, 53, 0.02), "b": floats(40, 5, 17, 0.5),
                "c": floats(10, 1, 3, 1.0)}
    sets = {"a": list(range(0, 120, 5)), "b": [0, 3, 39]}
    out = []
    for started in (True, False):
        encoder = _RecordingEncoder(residual)
        masks = {n: np.asarray(s, dtype=np.int64) for n, s in sets.items()}
        _, _, sent, side = encoder_round(encoder, grads, 0.0, 6, {"first": True,
                                         "shared_levels": 0.5}, masks, started=started)
        out.append({"case": "started" if started else "first_round", "started": started,
                    "levels": 0.5, "sequence": 6,
                    "gradient_bits": {n: bits(v) for n, v in grads.items()},
                    "residual_bits": {n: bits(v) for n, v in residual.items()}, "sets": sets,
                    "compressed_bits": {n: bits(v) for n, v in encoder.compressed.items()},
                    "sent_bits": {n: bits(t.values) for n, t in sent.tensors.items()},
                    "restored": {n: {"indices": i, "value_bits": b}
                                 for n, (i, b) in encoder.restored.items()},
                    "residual_after_bits": {n: bits(v) for n, v in encoder.state.items()},
                    "hex": side.hex()})
    return out


def context_patches() -> list[dict]:
    import dgc
    from dgc import SparseTensor, SparseUpdate
    from fedgc import context_patch
    from fedgc.patching import ProtocolError, apply_patch

    # "x": a version 0 tensor the model does not hold
    origin = {"w": floats(120, 37, 211, 0.2), "b": floats(6, 1, 5, 1.0), "x": floats(3, 1, 2, 1)}
    held = {"w": origin["w"].copy(), "b": origin["b"].copy()}
    held["w"][::4] += floats(30, 13, 29, 0.05)
    changed = torch.tensor([0, 1, 4, 8, 12, 60, 61, 100, 119], dtype=torch.int64)
    new_w = SparseTensor(changed, torch.from_numpy(floats(9, 5, 11, 0.3)), (120,))
    order = context_patch.rank_order(torch.from_numpy(held["w"]), torch.from_numpy(origin["w"]))
    segments = context_patch.split("w", new_w, order)
    b_patch = SparseTensor(torch.tensor([2, 5]), torch.tensor([9.0, -9.0]), (6,))

    def case(name: str, tensors: dict, context: list[str], sequence: int) -> dict:
        data = dgc.encode(SparseUpdate(tensors, sequence), grid_coding=True)
        torch_held = {n: torch.from_numpy(v.copy()) for n, v in held.items()}
        torch_origin = {n: torch.from_numpy(origin[n].copy()) for n in context}
        entry = {"case": name, "hex": data.hex(), "context": context,
                 "held_bits": {n: bits(v) for n, v in held.items()},
                 "shapes": {n: list(v.shape) for n, v in held.items()},
                 "initial_bits": {n: bits(origin[n]) for n in context}}
        try:
            model = apply_patch(torch_held, data, (), torch_origin)
        except ProtocolError as ex:
            entry["error"] = str(ex)
        else:
            entry["model_bits"] = {n: bits(v) for n, v in model.items()}
        return entry

    bad_segment = dict(segments)
    first = next(iter(bad_segment))
    s = bad_segment[first]
    bad_segment[first] = SparseTensor(s.indices, s.values, (s.shape[0] + 1,))
    return [
        case("segments_and_plain", {**segments, "b": b_patch}, ["w"], 7),
        case("no_segment", {"b": b_patch}, ["w"], 8),
        case("segment_of_wrong_size", bad_segment, ["w"], 9),
        case("whole_and_segments", {**segments, "w": new_w}, ["w"], 10),
        case("segment_beyond_the_last", {"w#5": SparseTensor(torch.tensor([0]),
                                                             torch.tensor([1.0]), (3,))},
             ["w"], 11),
        case("unknown_context", {"b": b_patch}, ["x"], 12),
    ]


def golden() -> dict:
    """The whole document, as it would be written now."""
    return {"spec": "docs/android.md, What dgc_sets needs on a phone",
            "rank_requests": rank_requests(), "rankings": rankings(), "exponents": exponents(),
            "on_grid": on_grid_cases(), "grid_updates": grid_updates(),
            "take_values": take_values_cases(), "sets_first": sets_first_cases(),
            "context_patches": context_patches()}


def text(doc: dict) -> str:
    """The file's text: one case a line."""
    def dump(value: object) -> str:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    parts = [f" {dump(key)}: " + ("[\n" + ",\n".join(f"  {dump(c)}" for c in value) + "\n ]"
                                  if isinstance(value, list) else dump(value))
             for key, value in doc.items()]
    return "{\n" + ",\n".join(parts) + "\n}\n"


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_PATH
    path.write_text(text(golden()), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
