"""The displacement work of a ``dgc_sets`` round: version 0 and the rankings, rebuilt or kept.

Clients and server of a run with DGC's sets ranked by displacement (``dgc.shared_rank =
displacement``) and patches coded by displacement rank (``downlink_context``) rank the entries of
the model a client holds by how far they have moved from version 0, every round. Before issue
39 each client built version 0 from the run's seed twice a round and both ends sorted every
ranking whole; now a process builds version 0 once (:func:`client.app.initial_model_of`), the
rankings sort distinct int64 keys (:mod:`dgc.ranking`) and the server moves its ranking along
with each version and keeps those of recent versions for the patches on them
(``server.downlink.Downlink.ranked``). This bench times both ways on the shipped scenarios'
models, interleaved, after checking they give the same bits:

- **client**: what one client does per round: version 0 for the patch's ranking and for the
  sets (built, rounded to the int8 grid), the ranking of the model it held (to join the patch)
  and the top of the ranking of the model it now holds (its sets);
- **server**: what the server does per round: the ranking behind each of ten patches (on
  versions 1 to 30 back) and the sets' top.

The models move as ``bench/downlink.py``'s do (a tenth of the weights' spread per round on a
tenth of the entries, a little elsewhere), through a real :class:`server.downlink.Downlink` with
``downlink_context`` at ``downlink_density`` 0.05.

Run: ``python bench/held_model.py`` (about a minute on one core).
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleaved_wall_cpu_ms, machine_line  # noqa: E402
from client.app import initial_model, initial_model_of  # noqa: E402
from dgc.int8_grid import round_initial  # noqa: E402
from dgc.ranking import ranked, top_positions  # noqa: E402
from fedgc.keys.run import TaskSpec  # noqa: E402
from fedgc.task_loader import get_task  # noqa: E402
from server.downlink import Downlink  # noqa: E402

#: Each scenario's task (their models: MLP, CNN, LSTM).
TASKS = ("mnist5k", "fashion-mnist", "shakespeare")
SHARED_DENSITY = 0.03  # dgc.shared_density
AGES = (1, 2, 3, 5, 7, 10, 12, 15, 20, 30)  # the ten patches of a round, versions back


def stable_order(model: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """The ranking as it was built before: a stable descending sort of the displacement."""
    moved = (model.reshape(-1).to(torch.float32) - origin.reshape(-1).to(torch.float32)).abs()
    return torch.sort(moved, descending=True, stable=True).indices


def trajectory(model: OrderedDict[str, torch.Tensor], versions: int, seed: int) -> Downlink:
    """A downlink with ``downlink_context`` after ``versions`` versions of a moving model."""
    d = Downlink("auto", 1000, 0.05, "int8", True, 0.5, "float16", True)
    d.reset(OrderedDict((k, v.clone()) for k, v in model.items()))
    g = torch.Generator().manual_seed(seed)
    busy = {k: torch.rand(v.shape, generator=g) < 0.1 for k, v in model.items()}
    for _ in range(versions):
        model = OrderedDict(
            (k, v + v.std().clamp_min(1e-3) * torch.where(
                busy[k], 0.1 * torch.randn(v.shape, generator=g),
                0.002 * torch.randn(v.shape, generator=g)))
            for k, v in model.items())
        d.advance(model, model)
    return d


def measure(name: str, versions: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Both ways' median wall and CPU ms per round on task ``name``'s model, after checking that
    they give the same bits."""
    task = get_task(name)
    spec = TaskSpec(name, "", "", "", "")
    built = initial_model(task, 0)
    d = trajectory(round_initial(built), versions, 1)
    grids = list(d.origin)
    counts = {n: max(1, round(SHARED_DENSITY * d.origin[n].numel())) for n in grids}
    held = d.grid_values_at(d.version - 10)
    now = d.sent_model
    bases = {age: d.grid_values_at(d.version - age) for age in AGES}
    # Same bits both ways before anything is timed.
    for n in grids:
        assert torch.equal(ranked(held[n], d.origin[n]), stable_order(held[n], d.origin[n]))
        assert torch.equal(top_positions(now[n], d.origin[n], counts[n]),
                           stable_order(now[n], d.origin[n])[:counts[n]])
        for age, base in bases.items():
            assert torch.equal(d.ranked(n, d.version - age, base[n]),
                               stable_order(base[n], d.origin[n]))
    v0 = initial_model_of(spec, task, 0)
    assert all(torch.equal(v0[k], built[k]) for k in built)

    def client_rebuilt() -> None:
        for _ in range(2):  # the patch's context, then the sets
            origin = round_initial(initial_model(task, 0))
        for n in grids:
            stable_order(held[n], origin[n])
            stable_order(now[n], origin[n])[:counts[n]]

    def client_kept() -> None:
        for _ in range(2):
            origin = round_initial(initial_model_of(spec, task, 0))
        for n in grids:
            ranked(held[n], origin[n])
            top_positions(now[n], origin[n], counts[n])

    def server_rebuilt() -> None:
        for n in grids:
            for base in bases.values():
                stable_order(base[n], d.origin[n])
            stable_order(now[n], d.origin[n])[:counts[n]]

    def server_kept() -> None:
        for n in grids:
            for age, base in bases.items():
                d.ranked(n, d.version - age, base[n])
            top_positions(now[n], d.origin[n], counts[n])

    return interleaved_wall_cpu_ms({"client_rebuilt": client_rebuilt,
                                    "client_kept": client_kept,
                                    "server_rebuilt": server_rebuilt,
                                    "server_kept": server_kept}, repeats=repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--versions", type=int, default=40, help="versions before timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tasks", default=",".join(TASKS))
    a = p.parse_args()
    torch.set_num_threads(1)
    print(machine_line(1))
    print(f"per round, median of {a.repeats}, interleaved; ms wall (CPU)")
    print(f"{'task':>14} {'side':>7} {'rebuilt ms':>16} {'kept ms':>16} {'speed-up':>9}")
    for name in a.tasks.split(","):
        t = measure(name, a.versions, a.repeats)
        for side in ("client", "server"):
            (rw, rc), (kw, kc) = t[f"{side}_rebuilt"], t[f"{side}_kept"]
            print(f"{name:>14} {side:>7} {rw:>7.1f} ({rc:>6.1f}) {kw:>7.1f} ({kc:>6.1f}) "
                  f"{rw / kw:>8.1f}x")


if __name__ == "__main__":
    main()
