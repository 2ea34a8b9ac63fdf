"""Where a catch-up patch's bytes go: index and value bytes per tensor, by the client's age, and
what ``downlink_context`` makes of them, measured on a finished run's own downlink.

The run must have ``downlink_values = int8`` and ``downlink_deltas`` (its checkpoint keeps every
version's changed grid entries, ``downlink_history``). For each version asked, the downlink is
rebuilt from the checkpoint as it stood then (its grid tensors; the one-dimensional tensors
are the final ones, so that ages past the last version only are exact for them), and for each
age ``a`` the patch on version ``v - a`` is built twice with the product's encoder
(``server.downlink.Downlink.coded_patch``): plain, split per tensor into index bytes (with
the index coding chosen) and value bytes (with the value coding, and ``delta`` where the
values are differences), and with ``downlink_context`` (ranked indices, non-zero value
coding), whose result is checked to rebuild the grid tensors bit for bit.

Run: ``python bench/patch_split.py RUN_FOLDER [VERSION...]`` (default: 100, 150 and the last).
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dgc.wire.decoder import read_structure  # noqa: E402
from dgc.wire.index_codings import CODING_NAMES  # noqa: E402
from dgc.wire.value_codings import GRID_CODED, GRID_RICE_CODED  # noqa: E402
from fedgc import protocol as P  # noqa: E402
from server.checkpoint import load_checkpoint  # noqa: E402
from server.downlink import Downlink  # noqa: E402

AGES = (1, 2, 3, 5, 10, 15, 20, 30, 50)


def rebuilt(state: dict, version: int, context: bool) -> Downlink:
    """The run's downlink as it stood at ``version`` (grid tensors exact)."""
    c = state["run_config"]
    d = Downlink("auto", int(c.get("downlink_history", 1000)),
                 float(c.get("downlink_density") or 0.05), "int8", True,
                 float(c.get("downlink_deadband", 0.5)), str(c.get("downlink_vectors",
                                                                   "float32")), context)
    d.load_state_dict(state)
    d.origin = d.grid_values_at(0) if context else {}
    if d.origin is None:
        raise SystemExit("the checkpoint's history does not reach version 0")
    then = d.grid_values_at(version)
    for name, t in then.items():
        d.broadcast[name] = t
    d.past = OrderedDict((u, ch) for u, ch in d.past.items() if u <= version)
    for name in then:
        changed = torch.zeros_like(d.changed_at[name])
        for u, ch in d.past.items():
            if name in ch:
                changed.view(-1)[ch[name][0]] = u
        d.changed_at[name] = changed
    d.version = version
    return d


def split(data: bytes, added: list[str]) -> list[str]:
    """Per tensor: entries, index coding and bytes, value coding and bytes."""
    _, records = read_structure(memoryview(data), None)
    out = []
    for r in records:
        coding = {GRID_CODED: "grid8", GRID_RICE_CODED: "grid-rice"}.get(
            r.value_coding, str(r.dtype).removeprefix("torch."))
        out.append(f"{r.name}: {r.count} entries ({r.count / r.numel:.1%}), index "
                   f"{CODING_NAMES[r.coding]} {r.index_bytes} B "
                   f"({8 * r.index_bytes / max(1, r.count):.1f} bits each), values {coding} "
                   f"{r.values_length} B ({8 * r.values_length / max(1, r.count):.1f} bits "
                   f"each){' delta' if r.name in added else ''}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder with checkpoint.pt")
    ap.add_argument("versions", nargs="*", type=int)
    args = ap.parse_args(argv)
    state = load_checkpoint(args.run)
    if state is None:
        raise SystemExit(f"{args.run}: no checkpoint.pt")
    last = int(state["model_version"])
    for v in args.versions or [100, 150, last]:
        plain, ranked = rebuilt(state, v, False), rebuilt(state, v, True)
        print(f"== version {v}")
        for a in (a for a in AGES if a <= v):
            p, r = plain.coded_patch((v - a,)), ranked.coded_patch((v - a,))
            base = {n: t.clone() for n, t in ranked.sent_model.items()}
            base.update(ranked.grid_values_at(v - a))
            got = P.apply_patch(base, r.data, r.added, {n: ranked.origin[n] for n in r.context})
            for n in ranked.grid_exponents:
                assert torch.equal(got[n].view(torch.int32),
                                   ranked.sent_model[n].view(torch.int32)), (v, a, n)
            print(f" age {a}: {len(p.data)} B plain, {len(r.data)} B ranked "
                  f"({len(r.data) / len(p.data) - 1:+.1%})")
            for line in split(p.data, p.added):
                print("    " + line)


if __name__ == "__main__":
    main()
