"""Which client a node is (issue 26 item 3): keys outside the run are refused, and with
``client_nodes`` a node is the key its authenticated node id is bound to, whatever it claims."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.app import app as real_app
from fedgc import protocol as P
from fedgc.settings import RunConfig, SettingsError, parse_client_nodes
from server.app import run_server
from server.local_grid import LocalGrid
from server.registry import ClientRegistry, RoundOutcome


def _claiming(claims: dict[int, object], asked: list[int] | None = None) -> ClientApp:
    """The real ClientApp, but the node of partition ``p`` claims ``claims[p]`` when asked."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if asked is not None:
            asked.append(partition)
        if partition not in claims:
            return real_app(msg, context)
        return Message(RecordDict({P.METRICS: MetricRecord({P.CLIENT_KEY: claims[partition]})}),
                       reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return real_app(msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return real_app(msg, context)

    return app


def _node(grid: LocalGrid, partition: int) -> int:
    return next(n for n, p in grid.partition_of.items() if p == partition)


def test_keys_outside_the_run_are_refused_never_sampled_and_not_asked_again() -> None:
    hostile = {2: -1, 3: 100, 4: 2**62, 5: 10**300}
    asked: list[int] = []
    grid = LocalGrid(_claiming(hostile, asked), 6, seed=1)
    grid.keys_are_partitions = False  # nodes that say their keys, as a deployment's do
    registry = ClientRegistry(seed=0)
    registry.bind(num_clients=4)
    chosen, connected = registry.sample_round(grid, 1, 6, min_nodes=6, timeout=30)
    assert connected == 6 and sorted(chosen) == [0, 1]
    assert sorted(registry.node_keys.values()) == [0, 1]
    assert sorted(registry.refused) == sorted(_node(grid, p) for p in hostile)
    assert "outside [0, 4)" in registry.refused[_node(grid, 3)]
    assert "(301 digits)" in registry.refused[_node(grid, 5)]
    asked.clear()
    assert sorted(registry.sample_round(grid, 2, 6, min_nodes=6, timeout=30)[0]) == [0, 1]
    assert asked == []  # the refused nodes are not asked again every round
    # A checkpoint's node ids pass the same check (a resume does not bring a refused key back).
    registry.register({77: 7, 78: 2})
    assert 77 not in registry.node_keys and registry.node_keys[78] == 2


def test_without_binding_a_node_may_take_another_clients_key() -> None:
    """The limit docs/threat_model.md states: without client_nodes, a claim is all there is,
    and the node that claimed a key last serves it (as a crashed node that came back)."""
    registry = ClientRegistry(seed=0)
    registry.bind(num_clients=4)
    registry.register({101: 0, 102: 1})
    registry.register({666: 1})  # a hostile node claims client 1's key after it
    assert registry.nodes_by_key([101, 102, 666]) == {0: 101, 1: 666}
    registry.bind(4, {0: 101, 1: 102})  # bound: the hostile claim no longer passes
    assert registry.nodes_by_key([101, 102, 666]) == {0: 101, 1: 102}
    registry.register({666: 1})
    assert registry.nodes_by_key([101, 102, 666]) == {0: 101, 1: 102}


def test_a_key_back_under_a_new_node_id_is_sent_the_config_whole() -> None:
    """A crashed SuperNode comes back under a new node id with a new Flower context, which
    holds no run config: the server must not name the config by digest alone to it (its first
    round back failed with CONFIG_MISSING in the deployment's crash test), while a client whose
    node did not change keeps being sent the digest only."""
    grid = LocalGrid(_claiming({2: 1}), 3, seed=1)  # partition 2's node is client 1, restarted
    grid.keys_are_partitions = False  # nodes that say their keys, as a deployment's do
    registry = ClientRegistry(seed=0)
    registry.bind(num_clients=2)
    registry.identify(grid, [_node(grid, 0), _node(grid, 1)], timeout=30)
    registry.settle(1, [RoundOutcome(0, "aggregated"), RoundOutcome(1, "aggregated")], 1,
                    config_digest="d1")
    assert registry.holds_config(0, "d1") and registry.holds_config(1, "d1")
    registry.identify(grid, [_node(grid, 0), _node(grid, 2)], timeout=30)  # node 1 is gone
    assert registry.nodes_by_key([_node(grid, 0), _node(grid, 2)]) == {0: _node(grid, 0),
                                                                       1: _node(grid, 2)}
    assert registry.holds_config(0, "d1") and not registry.holds_config(1, "d1")


def test_with_client_nodes_a_node_is_the_key_it_is_bound_to() -> None:
    grid = LocalGrid(_claiming({3: 1}), 5, seed=3)  # partition 3 claims client 1's key
    registry = ClientRegistry(seed=0)
    # Partition 3's node is bound to key 3 but claims 1; partition 4's node is not listed.
    registry.bind(5, {k: _node(grid, k) for k in range(4)})
    chosen, _ = registry.sample_round(grid, 1, 5, min_nodes=5, timeout=30)
    assert chosen == {k: _node(grid, k) for k in (0, 1, 2)}
    assert "binds it to key 3" in registry.refused[_node(grid, 3)]
    assert "not one of the authenticated nodes" in registry.refused[_node(grid, 4)]


def test_a_run_samples_only_keys_of_its_clients(tmp_path: Path) -> None:
    config = RunConfig.from_flat({
        "task": "digits", "num_clients": 4, "clients_per_round": 4, "rounds": 1,
        "partition": "iid", "method": "dense", "progress": False, "sim.engine": "local",
        "results_dir": str(tmp_path), "run_name": "r", "max_weight_ratio": 0.0})
    # Node 4 claims key 4 (outside the run's four clients), node 5 claims 2**62.
    grid = LocalGrid(_claiming({4: 4, 5: 2**62}), 6, seed=4)
    run_server(grid, config)
    with (tmp_path / "r" / "clients.csv").open() as fh:
        keys = sorted(int(row["client_key"]) for row in csv.DictReader(fh))
    assert keys == [0, 1, 2, 3]


@pytest.mark.parametrize("text, words", [
    ("0:5,1", "item '1' is not 'key:node_id'"),
    ("0:-5", "item '0:-5' is not"),
    ("0:0", "item '0:0' is not"),
    ("\u00b2:5", "is not 'key:node_id'"),
    ("0:5,0:6", "lists client key 0 or node 6 twice"),
    ("0:5,1:5", "twice"),
])
def test_client_nodes_must_be_key_node_pairs(text: str, words: str) -> None:
    with pytest.raises(SettingsError, match="client_nodes") as ex:
        RunConfig.from_flat({"client_nodes": text})
    assert words in str(ex.value)


def test_client_nodes_keys_are_keys_of_the_run() -> None:
    assert parse_client_nodes(" 0:12, 3:99 ") == {0: 12, 3: 99}
    assert RunConfig.from_flat({"num_clients": 4, "clients_per_round": 2,
                                "client_nodes": "0:12,3:99"}).server.client_nodes
    with pytest.raises(SettingsError, match=r"binds client keys \[4\] outside \[0, 4\)"):
        RunConfig.from_flat({"num_clients": 4, "clients_per_round": 2,
                             "client_nodes": "0:12,4:99"})


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[int, str]:
    from simulations.cli import main

    argv = ["run", "--set", "task=digits", "--set", "num_clients=4", "--set",
            "clients_per_round=2", "--set", "sim.engine=local", "--set", "progress=false",
            "--set", "partition=iid", "--set", f"results_dir={tmp_path}", "--set", "run_name=r"]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


def test_client_nodes_naming_no_connected_node_runs_no_round(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: such a run ran its rounds with 0 clients (and a fresh one then exited 1).
    The round waits for a node it may sample (round_timeout_s), then the run stops in one
    line naming why each node was refused; no round is counted."""
    code, err = _run(tmp_path, capsys, "rounds=2", "round_timeout_s=1",
                     "client_nodes=0:12345,1:67890")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "none of the 4 connected nodes may serve this run after 1 s (round_timeout_s): " \
        "client_nodes binds the nodes [12345, 67890];" in err
    assert "is not one of the authenticated nodes client_nodes lists" in err
    assert not (tmp_path / "r" / "rounds.csv").exists()


def test_a_resume_keeps_the_runs_client_nodes(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: a resume accepted a changed client_nodes; binding the keys to nodes that are
    not there, it ran an empty round, counted it as done and exited 0."""
    from server.local_grid import node_id

    bound = ",".join(f"{k}:{node_id(k, 0)}" for k in range(4))  # the local engine's nodes
    assert _run(tmp_path, capsys, "rounds=1", f"client_nodes={bound}")[0] == 0
    for changed in ("0:12345", ""):
        code, err = _run(tmp_path, capsys, "rounds=2", "resume=true",
                         f"client_nodes={changed}")
        assert code == 2 and len(err.splitlines()) == 1
        assert f"client_nodes = {bound!r} (now {changed!r})" in err
    with (tmp_path / "r" / "rounds.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 1
    assert _run(tmp_path, capsys, "rounds=2", "resume=true", f"client_nodes={bound}")[0] == 0
