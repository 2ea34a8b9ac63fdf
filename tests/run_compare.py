"""How a test compares a run made here with results made elsewhere (a snapshot, a fixture).

Float kernels differ across CPUs (AVX2, AVX-512, NEON, PyTorch's scalar ``default``): a sum taken
in another order moves a loss in its 8th digit, a top-k selection between near-tied entries
can flip, and the runs part from there. So a run is compared bit for bit only where this
machine's float kernels are those the snapshots were taken with, which :func:`same_kernels`
decides with a probe of pure PyTorch (the kernels a run uses, on fixed inputs, none of fedgc's
code: a change of fedgc cannot pass it off as another machine). Elsewhere each float-dependent
value must be within what another machine's kernels were measured to move it by
(:data:`TOLERANCES`), and what no float decides (rounds, clients, partitions, statuses, the
config) is still compared exactly.

The tolerances were measured on the snapshots' runs (2026-12-06, torch 2.13.0) twice: under the
lowered CPU dispatch of ``make test``'s second pass (``ATEN_CPU_CAPABILITY=default
ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE``) on an AMD EPYC with AVX2, and between that
machine and the one the snapshots were first taken on. The largest difference of each kind
(nearly all in ``netem_drop``: 6 rounds, DGC's threshold selection, the emulator's drops) is
noted beside each tolerance, which is 2 to 3 times it. ``make test`` runs every test of the
``cross_cpu`` marker a second time under that dispatch (docs/guide.md, "Testing").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import torch

PROBE_FILE = Path(__file__).parent / "golden" / "runs" / "float_probe.json"

#: (scope, column) -> (kind, bound, the largest difference measured): "rel" or "abs" difference
#: allowed where the kernels are another machine's. Scopes: "rounds" (rounds.csv), "clients"
#: (clients.csv), "summary" (summary.json). A column not here is compared exactly. Measured
#: (module docstring) under the lowered dispatch, then between this machine and the one the
#: snapshots were first taken on (their values before 2026-12-06), the larger of the two.
TOLERANCES: dict[tuple[str, str], tuple[str, float, str]] = {
    ("rounds", "accuracy"): ("abs", 0.02, "0.0084: 3 of 359 test samples"),
    **{("summary", key): ("abs", 0.02, "a round's 0.0084")
       for key in ("best_accuracy", "final_accuracy", "last10_accuracy")},
    ("rounds", "loss"): ("rel", 0.05, "2.1%"),
    ("summary", "final_loss"): ("rel", 0.05, "a round's 2.1%"),
    ("rounds", "train_loss"): ("rel", 0.02, "0.35%"),
    ("clients", "train_loss"): ("rel", 0.02, "0.77%"),
    # DGC's threshold selection sends more or fewer entries once the runs part; a flipped top-k
    # entry changes the Rice code of its gaps.
    ("clients", "uplink_bytes"): ("rel", 0.35, "14%"),
    ("clients", "nnz"): ("rel", 0.35, "16%"),
    ("clients", "density"): ("rel", 0.35, "16%"),
    ("clients", "compression_ratio"): ("rel", 0.35, "17%"),
    ("rounds", "uplink_bytes"): ("rel", 0.12, "3.9%"),
    ("rounds", "nnz"): ("rel", 0.12, "4.4%"),
    ("summary", "uplink_bytes"): ("rel", 0.12, "a round's 3.9%"),
    ("summary", "uplink_compression"): ("rel", 0.12, "a round's 3.9%"),
    # The int8 broadcast's patches: entries that moved past the deadband.
    ("clients", "downlink_bytes"): ("rel", 0.01, "0.11%"),
    ("rounds", "downlink_bytes"): ("rel", 0.01, "0.011%"),
    ("summary", "downlink_bytes"): ("rel", 0.01, "a round's 0.011%"),
    ("summary", "downlink_compression"): ("rel", 0.01, "a round's 0.011%"),
    ("summary", "total_bytes"): ("rel", 0.01, "the uplink's share of 4.4%"),
    ("summary", "total_compression"): ("rel", 0.01, "the uplink's share of 4.4%"),
}


def float_probe() -> str:
    """A digest of what this machine's kernels compute on fixed inputs: an MLP's forward,
    backward and momentum SGD steps (GEMM, ReLU, log-softmax, the reductions of a loss), a
    convolution (oneDNN), float32
    and float64 sums of a million entries, a multiply-add (fused by vectorized kernels, not by
    scalar ones), a float16 cast. One thread, as a run's server and in-process clients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(35)
        model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.ReLU(),
                                    torch.nn.Linear(100, 10))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        big = torch.randn(1_000_003, generator=g)
        conv = torch.nn.functional.conv2d(torch.randn(8, 1, 8, 8, generator=g),
                                          torch.randn(16, 1, 3, 3, generator=g))
        parts = [*(p.detach() for p in model.parameters()), torch.stack(losses), conv,
                 big.sum().reshape(1), big.double().pow(2).sum().reshape(1),
                 torch.add(big, big * 0.5, alpha=0.7)[:4096],
                 (big[:4096] / 3).to(torch.float16).float()]
        digest = hashlib.sha256()
        for t in parts:
            digest.update(t.contiguous().numpy().tobytes())
        return digest.hexdigest()
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def same_kernels() -> bool:
    """Whether this machine's float kernels compute :func:`float_probe` as the machine the
    snapshots were taken on did (``tests/golden/float_probe.json``)."""
    return float_probe() == json.loads(PROBE_FILE.read_text(encoding="utf-8"))["digest"]


def close(scope: str, key: str, got: object, want: object, exact: bool) -> bool:
    """Whether ``got`` stands for ``want`` (``scope``'s column ``key``): equal as text with
    ``exact`` or for a column without a tolerance, else within :data:`TOLERANCES`."""
    if str(got) == str(want):
        return True
    rule = TOLERANCES.get((scope, key))
    if exact or rule is None or got is None or want is None:
        return False
    try:
        g, w = float(got), float(want)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if math.isnan(g) or math.isnan(w):
        return math.isnan(g) and math.isnan(w)
    kind, bound, _ = rule
    return abs(g - w) <= (bound * abs(w) if kind == "rel" else bound)
