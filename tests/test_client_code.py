"""No code from a config on a client (issue 26 item 2): a deployed node calls only the
``module:callable`` references its own node config lists, each for the run key it lists it
under (issue 35), whatever a train message names; simulated nodes keep running the simulating
user's own callables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from client.app import app as client_app
from fedgc import protocol as P
from fedgc.refs import ALLOWED_CALLABLES, CallableNotAllowedError, parse_allowed, resolve_callable
from fedgc.settings import TrainSettings, to_flat
from server.local_grid import LocalGrid

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OWN = "own_task.task:build"


def _send(grid: LocalGrid, settings: TrainSettings, kind: str = MessageType.TRAIN,
          model: torch.nn.Module | None = None) -> Message:
    from tasks import get_task

    torch.manual_seed(0)
    arrays = ArrayRecord((model or get_task("digits").build_model()).state_dict())
    node = next(iter(grid.partition_of))
    cfg = ConfigRecord({**to_flat(settings), P.SERVER_ROUND: 1, P.MODEL_VERSION: 0,
                        P.ACK_SEQUENCE: -1, P.DOWNLINK: "dense"})
    msg = Message(RecordDict({P.ARRAYS: arrays, P.CONFIG: cfg}), dst_node_id=node,
                  message_type=kind)
    (reply,) = grid.send_and_receive([msg])
    return reply


@pytest.fixture
def evil_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module whose import, and whose callable, each leave a mark."""
    (tmp_path / "evil_mod.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(tmp_path / 'imported')!r}).touch()\n"
        "def build(**kw):\n"
        f"    Path({str(tmp_path / 'called')!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evil_mod", raising=False)
    return tmp_path


@pytest.mark.parametrize("task, options", [
    ("subprocess:getoutput", {"cmd": "touch {marker}"}),
    ("os:system", {"command": "touch {marker}"}),
    ("builtins:exit", {}),
    ("evil_mod:build", {}),
])
@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_a_message_cannot_make_a_deployed_node_run_code(
        evil_module: Path, task: str, options: dict, kind: str) -> None:
    marker = evil_module / "shell-ran"
    grid = LocalGrid(client_app, 2)  # a deployed node's config: no allowed-callables
    settings = TrainSettings(task=task, num_clients=2, clients_per_round=2,
                             task_options=json.dumps(options).replace("{marker}", str(marker)),
                             state_dir=str(evil_module / "state"))
    reply = _send(grid, settings, kind)
    assert reply.has_error()
    assert f"task = {task!r} is not allowed on this node" in reply.error.reason
    assert ALLOWED_CALLABLES in reply.error.reason
    assert not marker.exists() and not (evil_module / "state").exists()  # nothing written
    assert not (evil_module / "imported").exists() and not (evil_module / "called").exists()
    assert "evil_mod" not in sys.modules


def test_a_node_runs_the_callables_its_own_config_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    grid = LocalGrid(client_app, 2,
                     node_config={ALLOWED_CALLABLES: f"method=json:loads, task={OWN}"})
    settings = TrainSettings(task=OWN, num_clients=2, clients_per_round=2, local_steps=1,
                             task_options='{"num_train": 40, "num_test": 20}',
                             state_dir=str(tmp_path / "state"))
    from own_task.task import build

    reply = _send(grid, settings, model=build(num_train=40, num_test=20).build_model())
    assert not reply.has_error(), reply.error.reason
    assert reply.content.metric_records[P.METRICS]["num-examples"] >= 1
    other = TrainSettings(task="own_task.task:waves", num_clients=2, clients_per_round=2,
                          state_dir=str(tmp_path / "state"))
    reply = _send(grid, other)
    assert reply.has_error() and "(it lists: method=json:loads, task=own_task.task:build)" in \
        reply.error.reason


@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_a_message_cannot_make_a_deployed_node_load_a_method(evil_module: Path,
                                                             kind: str) -> None:
    """A method is code too: ``method = "module:callable"`` in a train message is refused
    before the settings are parsed (parsing a method key loads the method)."""
    grid = LocalGrid(client_app, 2)
    node = next(iter(grid.partition_of))
    flat = {**to_flat(TrainSettings(task="digits", num_clients=2, clients_per_round=2,
                                    state_dir=str(evil_module / "state"))),
            "method": "evil_mod:build"}
    torch.manual_seed(0)
    from tasks import get_task

    cfg = ConfigRecord({**flat, P.SERVER_ROUND: 1, P.MODEL_VERSION: 0, P.ACK_SEQUENCE: -1,
                        P.DOWNLINK: "dense"})
    msg = Message(RecordDict({P.ARRAYS: ArrayRecord(get_task("digits").build_model()
                                                    .state_dict()), P.CONFIG: cfg}),
                  dst_node_id=node, message_type=kind)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error()
    assert "method = 'evil_mod:build' is not allowed on this node" in reply.error.reason
    assert "evil_mod" not in sys.modules and not (evil_module / "imported").exists()
    assert not (evil_module / "state").exists()


def test_a_method_loaded_by_the_server_is_still_refused_to_a_node(evil_module: Path) -> None:
    """The registry keeps a loaded method per process; a node's allow-list is checked first, so
    a method the server's process loaded (its own config) is not handed to a node that does not
    allow it."""
    from fedgc.methods import registry

    (evil_module / "evil_method.py").write_text(
        "from fedgc.methods.dense import Dense\n"
        "class EvilDense(Dense):\n"
        "    name = 'evil_dense'\n"
        "    baseline = False\n"
        "def make():\n"
        "    return EvilDense()\n")
    ref = "evil_method:make"
    try:
        assert registry.get(ref).name == "evil_dense"  # the server: any
        with pytest.raises(CallableNotAllowedError, match="method = 'evil_method:make'"):
            registry.get(ref, frozenset({f"task={OWN}"}))
        assert registry.get(ref, frozenset({f"method={ref}"})).name == "evil_dense"
    finally:
        registry._LOADED.pop(ref, None)


def test_the_one_loading_function_refuses_before_importing(evil_module: Path) -> None:
    with pytest.raises(CallableNotAllowedError, match="method = 'evil_mod:build' is not "
                                                      "allowed on this node"):
        resolve_callable("evil_mod:build", allowed=frozenset({f"task={OWN}"}), key="method")
    assert "evil_mod" not in sys.modules and not (evil_module / "imported").exists()
    assert callable(resolve_callable("evil_mod:build",
                                     allowed=frozenset({"task=evil_mod:build"})))
    assert callable(resolve_callable("evil_mod:build"))  # the server: its own config


def test_deploy_lets_its_nodes_call_the_runs_own_task_only(tmp_path: Path) -> None:
    from simulations.deploy.cli import _deployment_config, _run_parser

    args = _run_parser().parse_args(["--nodes", "2", "--workdir", str(tmp_path)])
    own = _deployment_config(args, allowed=f"task={OWN}").node_config(1, 2)
    assert own == {"partition-id": 1, "num-partitions": 2, ALLOWED_CALLABLES: f"task={OWN}"}
    assert ALLOWED_CALLABLES not in _deployment_config(args).node_config(0, 2)


@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_a_callable_is_allowed_for_its_own_key_only(evil_module: Path, kind: str) -> None:
    """Issue 35: the allow-list was per reference, so a node that lists ``evil_mod:build`` as
    its task let the server call it as the method factory. Each entry now binds its key."""
    grid = LocalGrid(client_app, 2, node_config={ALLOWED_CALLABLES: "task=evil_mod:build"})
    node = next(iter(grid.partition_of))
    flat = {**to_flat(TrainSettings(task="digits", num_clients=2, clients_per_round=2,
                                    state_dir=str(evil_module / "state"))),
            "method": "evil_mod:build"}
    from tasks import get_task

    torch.manual_seed(0)
    cfg = ConfigRecord({**flat, P.SERVER_ROUND: 1, P.MODEL_VERSION: 0, P.ACK_SEQUENCE: -1,
                        P.DOWNLINK: "dense"})
    msg = Message(RecordDict({P.ARRAYS: ArrayRecord(get_task("digits").build_model()
                                                    .state_dict()), P.CONFIG: cfg}),
                  dst_node_id=node, message_type=kind)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error()
    assert "method = 'evil_mod:build' is not allowed on this node" in reply.error.reason
    assert "(it lists: task=evil_mod:build)" in reply.error.reason
    assert "evil_mod" not in sys.modules and not (evil_module / "imported").exists()
    # As the task it is listed for, the node calls it (it returns no Task: an error after).
    reply = _send(grid, TrainSettings(task="evil_mod:build", num_clients=2, clients_per_round=2,
                                      state_dir=str(evil_module / "state")), kind)
    assert (evil_module / "called").exists()


def test_an_allow_list_entry_names_its_key() -> None:
    assert parse_allowed(" task=a.b:c , method=d:e ") == frozenset({"task=a.b:c", "method=d:e"})
    assert parse_allowed("task=a:b, *") is None and parse_allowed("") == frozenset()
    for bad in ("a.b:c", "model=a:b", "task=a", "task=", "=a:b"):
        with pytest.raises(CallableNotAllowedError, match="is not 'key=module:callable'"):
            parse_allowed(bad)
    grid = LocalGrid(client_app, 2, node_config={ALLOWED_CALLABLES: OWN})
    reply = _send(grid, TrainSettings(task="digits", num_clients=2, clients_per_round=2))
    assert reply.has_error() and f"allowed-callables entry '{OWN}' is not " \
        "'key=module:callable'" in reply.error.reason
