"""A million clients on one box: the in-process grid holds nothing per node until it runs it,
the registry samples without a query per node, and a task makes each client's data from its
seed (``examples/own_task``'s ``build_per_client``)."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest
import torch

from client.app import app as client_app
from fedgc.settings import RunConfig, SettingsError
from fedgc.task_loader import ALLOWED_CALLABLES
from server.app import run_server
from server.local_grid import LocalGrid, node_id, partition_of_node
from server.preflight import PreflightError, check_partitions
from server.registry import ClientRegistry, KeyedGrid

ROOT = Path(__file__).resolve().parents[1]
PER_CLIENT = "own_task.task:build_per_client"


@pytest.fixture
def examples_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


def test_node_ids_are_a_bijection_of_partitions_and_seed() -> None:
    ids = [node_id(p, 5) for p in range(20_000)]
    assert len(set(ids)) == len(ids) and all(0 < n < 2**63 for n in ids)
    assert [partition_of_node(n, 5) for n in ids[:100]] == list(range(100))
    assert partition_of_node(ids[7], 6) is None  # another seed's grid does not know it
    grid = LocalGrid(client_app, 3, seed=5)
    assert sorted(grid.partition_of.values()) == [0, 1, 2]
    assert node_id(3, 5) not in grid.partition_of  # beyond num_nodes


def test_sampling_a_million_keys_is_the_draw_of_the_sorted_list() -> None:
    registry = ClientRegistry(seed=3)
    grid = LocalGrid(client_app, 1_000_000, seed=3)
    assert isinstance(grid, KeyedGrid)
    tracemalloc.start()
    node_of, connected = registry.sample_round(grid, 4, 100, 100, timeout=1.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert connected == 1_000_000 and peak < 1_000_000  # bytes: nothing per node
    expected = random.Random(3 * 1_000_003 + 4).sample(list(range(1_000_000)), 100)
    assert list(node_of) == expected
    assert all(grid.partition_of[node] == key for key, node in node_of.items())
    assert registry.key_of(node_of[expected[0]]) == expected[0]
    # A grid whose nodes carry other keys is identified by query, as before.
    assert not LocalGrid(client_app, 3, node_config={"client-key": 9}).keys_are_partitions


def test_a_million_clients_run_holding_only_the_sampled_ones(tmp_path: Path,
                                                             examples_path: None) -> None:
    config = RunConfig.from_flat({
        "task": PER_CLIENT, "task_options": {"samples": 8}, "num_clients": 1_000_000,
        "clients_per_round": 3, "rounds": 2, "sim.engine": "local", "progress": False,
        "results_dir": str(tmp_path), "run_name": "million", "checkpoint": False,
        "eval_samples": 100})
    # As the local engine makes its nodes: they run the simulating user's own task.
    grid = LocalGrid(client_app, config.train.num_clients, seed=config.train.seed,
                     node_config={ALLOWED_CALLABLES: "*"})
    summary = run_server(grid, config)
    assert summary["clients_aggregated"] == 6 and summary["clients_failed"] == 0
    assert len(grid.contexts) <= 6  # the nodes it ran, not a million
    # The client records (beside them: the folder's owner mark and the store's manifest).
    stored = list(config.state_dir.glob("*.state"))
    assert 0 < len(stored) <= 6


def test_per_client_data_is_made_from_the_key_and_checked_before_round_1(
        examples_path: None) -> None:
    from own_task.task import build_per_client

    task = build_per_client(samples=6, skew=1.0, seed=2)
    x, y = task.data_of(999_999, 1_000_000)
    again, _ = task.data_of(999_999, 1_000_000)
    assert x.shape == (6, 1, 32) and torch.equal(x, again) and bool((y == 999_999 % 4).all())
    assert not torch.equal(task.data_of(1, 10)[0], x[:6])
    with pytest.raises(Exception, match="client key 10 has no data"):
        task.data_of(10, 10)
    bad = RunConfig.from_flat({"task": PER_CLIENT, "task_options": {"samples": 0},
                               "num_clients": 5, "clients_per_round": 2})
    with pytest.raises(SettingsError, match="samples must be >= 1"):
        check_partitions(bad)


def test_a_client_without_data_stops_the_run_before_round_1(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    (tmp_path / "empty_clients.py").write_text(
        "import torch\nfrom tasks import Task\n\n"
        "def build():\n"
        "    x = torch.zeros(4, 3)\n"
        "    y = torch.zeros(4, dtype=torch.int64)\n"
        "    data = lambda key: (x[:key % 2], y[:key % 2])\n"
        "    return Task('e', 'mlp', 2, x[:0], y[:0], x, y, client_data=data)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig.from_flat({"task": "empty_clients:build", "num_clients": 7,
                                  "clients_per_round": 2})
    with pytest.raises(PreflightError, match=r"client_data\(0\) holds no sample"):
        check_partitions(config)


@pytest.mark.parametrize("engine", ["local", "batched"])
def test_a_simulated_node_runs_the_users_own_task_on_either_in_process_engine(
        tmp_path: Path, examples_path: None, engine: str) -> None:
    """Through the command line, as a user runs it: a simulated node trusts the run's own
    ``module:callable`` (a deployed node only what its node config lists)."""
    from simulations.cli import main

    argv = ["run"]
    for s in (f"task={PER_CLIENT}", 'task_options={"samples": 8}', "num_clients=1000000",
              "clients_per_round=2", "rounds=1", f"sim.engine={engine}", "progress=false",
              f"results_dir={tmp_path}", "run_name=own", "checkpoint=false", "eval_samples=50"):
        argv += ["--set", s]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert summary["clients_aggregated"] == 2 and summary["clients_failed"] == 0
