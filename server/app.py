"""The Flower ServerApp: read the run config, build task and DGCStrategy, run, write results.

``app`` reads ``context.run_config`` (``[tool.flwr.app.config]`` under ``flwr run .``);
:func:`run_server` is the same main with a :class:`fedgc.settings.RunConfig` in hand, which is what
``python -m simulations`` calls inside Flower's simulation engine
(:func:`simulations.runner.run_engine`). :func:`flwr_app_config` is the app config of
``pyproject.toml``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedgc import devices, methods
from fedgc.flower_log import drop_noise, report_once
from fedgc.schema import to_flat
from fedgc.settings import RunConfig, SettingsError, method_key_classes, parse_client_nodes
from fedgc.task_loader import load_task
from server import defences
from server.checkpoint import CheckpointError
from server.extensions import Column, RoundExtension, columns_of
from server.folders import RunFolderError as RunFolderError  # re-exported: its old home
from server.folders import RunLock, make_folders, plan_folders
from server.local_grid import LocalGrid
from server.preflight import PreflightError, check_run
from server.records import RoundRecord
from server.registry import NoClientsError
from server.results import summarize, write_clients, write_rounds, write_summary
from server.strategy import DGCStrategy
from server.tensorboard import RoundWriter

app = ServerApp()

logger = logging.getLogger("fedgc")


#: Keys of the ``python -m simulations`` engine (Ray resources, in-process engine): under
#: ``flwr run`` Flower's federation config sets those, so the app config leaves them out.
ENGINE_KEY_PREFIX = "sim."


def flwr_app_config() -> dict[str, bool | int | float | str]:
    """The ``[tool.flwr.app.config]`` of ``pyproject.toml``: every RunConfig key that means
    something under ``flwr run``, with the same default as ``python -m simulations run``.

    Flower accepts ``flwr run -c key=value`` only for keys this table holds.
    """
    config = RunConfig()
    flat = config.to_flat()
    flat["run_name"] = ""  # the default, not the folder RunConfig() just named: one per run
    for key in config.server.by_method | config.train.by_method | config.own_by_method:
        flat[key] = ""  # each method's own default, as `python -m simulations run` gives it
    for cls in method_key_classes(methods.registered()):  # every method's own keys
        flat.update(to_flat(cls()))
    return {k: v for k, v in sorted(flat.items()) if not k.startswith(ENGINE_KEY_PREFIX)}


def flwr_app_config_toml() -> str:
    """:func:`flwr_app_config` as the TOML lines of ``pyproject.toml`` (dotted keys)."""
    def value(v: bool | int | float | str) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string of printable characters is a TOML string
        return repr(v)

    lines = ["[tool.flwr.app.config]"]
    lines += [f"{k} = {value(v)}" for k, v in flwr_app_config().items()]
    return "\n".join(lines) + "\n"


class NothingAggregatedError(RuntimeError):
    """A run ended in which no round aggregated a single update: it did not train at all."""


def prepare_run_dir(config: RunConfig) -> RunLock:
    """Check that the run may use its folders and can work, then create them: a run refused
    here leaves nothing behind (:mod:`server.folders`, :func:`server.preflight.check_run`).
    Returns the run folder's lock, held: the caller releases it when the run ends, or at once
    when it only checks (the run itself takes it again).

    Raises
    ------
    RunFolderError
        The folder holds a run (and neither ``resume`` nor ``overwrite`` is set), belongs to
        another run or a comparison, cannot be created or written, or another process runs
        in it.
    server.preflight.PreflightError
        The run cannot work (clients without data, a ``state_dir`` of another run or that
        cannot be written, a damaged checkpoint to resume).
    """
    plan = plan_folders(config)
    check_run(config)
    return make_folders(config, plan)


def _clock(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def progress_line(record: RoundRecord, rounds: int, elapsed: float | None = None,
                  rounds_timed: int = 0, columns: Sequence[Column] = (),
                  totals: Sequence[float] = ()) -> str:
    """One human-readable line per round.

    ``elapsed``: seconds since this process started its first round, of which ``rounds_timed``
    rounds are done (a resumed run times only its own rounds); with them the line ends with the
    elapsed time and an estimate of the time left. Over-selected clients whose valid update was
    not needed show as ``surplus`` (not failures). ``columns``: the extensions' columns, each
    shown by its ``progress`` format with the round's value and ``totals``' (the run's so far:
    a network-emulator run shows the round's virtual seconds and the run's, what its report
    plots).
    """
    ratio = record.dense_uplink_bytes / record.uplink_bytes if record.uplink_bytes else 0.0
    line = (f"round {record.round:>4}/{rounds}  acc {record.accuracy:.4f}  loss {record.loss:.4f}"
            f"  up {record.uplink_bytes / 1e3:9.1f} kB (x{ratio:7.1f})"
            f"  down {record.downlink_bytes / 1e6:7.2f} MB"
            f"  clients {record.clients_aggregated}/{record.clients_sampled}"
            f" failed {record.clients_failed}")
    if record.clients_surplus:
        line += f" surplus {record.clients_surplus}"
    line += f"  {record.wall_seconds:5.1f}s"
    for i, c in enumerate(columns):
        if c.progress and record.extra.get(c.name):
            total = totals[i] if i < len(totals) else record.extra[c.name]
            line += "  " + c.progress.format(record.extra[c.name], total)
    if elapsed is not None and rounds_timed > 0:
        left = elapsed / rounds_timed * max(rounds - record.round, 0)
        line += f"  elapsed {_clock(elapsed)} ETA {_clock(left)}"
    return line


def evaluation_split(task: Any, eval_samples: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test samples the server scores every round: all, or a seeded random subset.

    A random subset, not the first ``eval_samples``: a test split may be ordered (Shakespeare's
    is grouped by role).
    """
    n = len(task.test_y)
    if eval_samples == 0 or eval_samples >= n:
        return task.test_x, task.test_y
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:eval_samples]
    keep = keep.sort().values
    return task.test_x[keep], task.test_y[keep]


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` reaches simulated clients (fedgc's in-process engine, Flower's
    simulation engine), which run the user's own code and config, rather than deployed ones."""
    from flwr.superlink.grid import InMemoryGrid

    # A grid that wraps another (simulations.interrupt.StoppableGrid, around Flower's
    # simulation grid) reaches the clients its inner grid reaches.
    while not isinstance(grid, (LocalGrid, InMemoryGrid)):
        inner = getattr(grid, "grid", None)
        if not isinstance(inner, Grid):
            return False
        grid = inner
    return True


def resolve_robust(config: RunConfig, grid: Grid) -> RunConfig:
    """``config`` with ``robust = auto`` decided by where its clients run: off for simulated
    clients (the baseline stays plain FedAvg), on for deployed ones, which the server does not
    trust (SuperNodes, phones behind the bridge). The run's header says which
    (:func:`server.defences.describe`)."""
    if config.server.robust != "auto":
        return config
    return config.with_overrides({"robust": "off" if simulated(grid) else "on"})


def run_server(grid: Grid, config: RunConfig,
               on_round: Callable[[RoundRecord], None] | None = None,
               extensions: Sequence[RoundExtension] = (),
               strategy_factory: Callable[..., DGCStrategy] = DGCStrategy) -> dict[str, Any]:
    """Run a whole federation on ``grid`` and write the results files; return the summary.

    ``extensions`` hook into every round (:mod:`server.extensions`: the network emulator's
    are :func:`simulations.netem.integration.extensions`); they add columns to the results and
    keys to the summary. ``strategy_factory(config, on_round=..., extensions=...)`` builds the
    strategy.
    """
    started = time.time()
    torch.set_num_threads(1)
    config = resolve_robust(config, grid)
    with prepare_run_dir(config):  # the run folder's lock, held until the run ends
        return _serve(grid, config, started, on_round, extensions, strategy_factory)


def _serve(grid: Grid, config: RunConfig, started: float,
           on_round: Callable[[RoundRecord], None] | None,
           extensions: Sequence[RoundExtension],
           strategy_factory: Callable[..., DGCStrategy]) -> dict[str, Any]:
    """:func:`run_server` in its prepared run folder."""
    s, t = config.server, config.train
    task = load_task(t.task_spec())
    torch.manual_seed(t.seed)
    model = task.build_model()
    run_dir = config.run_dir
    test_x, test_y = evaluation_split(task, s.eval_samples, t.seed)
    # The global model is evaluated where the clients train (sim.device, checked by
    # prepare_run_dir); it is kept, aggregated and sent on the host.
    device = devices.resolve(t.device)
    judge = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    test_x, test_y = test_x.to(device), test_y.to(device)
    columns: list[Column] = []
    board = None

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        judge.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = task.evaluate(judge, test_x, test_y)
        return MetricRecord({"accuracy": float(accuracy), "loss": float(loss)})

    timed: list[int] = []  # rounds run by this process (a resumed run starts later)

    def round_done(record: RoundRecord) -> None:
        write_rounds(run_dir, strategy.rounds)
        if board is not None:
            board.write(record, strategy.rounds[:-1])
        timed.append(record.round)
        if s.progress:
            totals = [sum(r.extra.get(c.name, 0) for r in strategy.rounds) for c in columns]
            print(progress_line(record, s.rounds, time.time() - started, len(timed), columns,
                                totals), flush=True)
        if on_round is not None:
            on_round(record)

    strategy = strategy_factory(config, on_round=round_done, extensions=extensions)
    # A node's client key is its claim: only keys of this run, bound to authenticated nodes
    # when client_nodes lists them (docs/threat_model.md).
    strategy.registry.bind(t.num_clients, parse_client_nodes(s.client_nodes))
    columns = columns_of(strategy.extensions)
    if s.tensorboard:
        board = RoundWriter(run_dir, columns)
    guard = (s.max_weight_ratio, s.max_norm_ratio, s.aggregation, s.trim_fraction,
             s.min_cosine)
    if s.progress:
        trust = " (robust=on: deployed clients are not trusted)" if s.robust == "on" else ""
        line = defences.describe(*guard, bucket_size=s.bucket_size,
                                 gate_reference=s.gate_reference, gate_memory=s.gate_memory,
                                 gate_memory_below=s.gate_memory_below,
                                 gate_first_bar=s.gate_first_bar,
                                 clip_radius_clean=s.clip_radius_clean)
        print(f"fedgc: {line}{trust}", flush=True)
        if strategy.privacy is not None:
            print(f"fedgc: {strategy.privacy.describe()}", flush=True)
    train_config = ConfigRecord(config.client_config())
    try:
        result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=s.rounds,
                                timeout=s.round_timeout_s, train_config=train_config,
                                evaluate_fn=evaluate)
    finally:
        if board is not None:
            board.close()
    torch.save(result.arrays.to_torch_state_dict(), run_dir / "model.pt")
    write_rounds(run_dir, strategy.rounds)
    write_clients(run_dir, strategy.client_rows)
    extra: dict[str, Any] = {}
    for ext in strategy.extensions:
        extra.update(ext.summary(strategy.rounds))
    summary = summarize(strategy.rounds, t.method, {
        "label": strategy.method.title,
        "task": t.task, "num_clients": t.num_clients, "clients_per_round": t.clients_per_round,
        "density": strategy.method.uplink_density(t),
        "num_parameters": sum(v.numel() for v in strategy.model.values()),
        "rejections": strategy.rejections, "process_seconds": time.time() - started,
        "config": config.to_flat(), **extra,
        "defences": defences.in_force(
            *guard, [r.reason for r in strategy.client_rows if r.status == "aggregated"],
            [r.reason for r in strategy.client_rows if r.status == "rejected"]),
    })
    write_summary(run_dir, summary)
    check_something_aggregated(strategy.rounds, strategy.client_rows, run_dir)
    return summary


def check_something_aggregated(rounds: list[RoundRecord], rows: list[Any], run_dir: Any) -> None:
    """Raise :class:`NothingAggregatedError` (naming the first client failure) when no round
    aggregated anything; the results files are written first, for the diagnosis."""
    if not rounds or any(r.clients_aggregated for r in rounds):
        return
    failed = [r for r in rows if r.status != "aggregated" and r.reason]
    first = (f"; first failure (round {failed[0].round}, client {failed[0].client_key}, "
             f"{failed[0].status}): {failed[0].reason[:300]}") if failed else ""
    raise NothingAggregatedError(f"no round of {len(rounds)} aggregated any update, so the "
                                 f"model never trained (see {run_dir}/clients.csv){first}")


class FederationSizeError(RuntimeError):
    """Under Flower's simulation runtime, the federation has not one SuperNode per client."""


#: Seconds the simulation runtime may take to register its SuperNodes (it does so as the
#: ServerApp starts; 10,000 in well under a second here).
NODES_SETTLE_S = 10.0


def check_federation(grid: Grid, config: RunConfig) -> None:
    """Under Flower's simulation runtime (``flwr run`` on a local SuperLink), refuse a
    federation without one SuperNode per client, saying how to size it.

    The runtime registers all of its ``num-supernodes`` nodes as the ServerApp starts, and
    none joins later: a run needing more would wait for ever, and a node beyond ``num_clients``
    would hold no data. On a deployment (SuperNodes connecting over the network) nodes come
    and go, and the registry waits for them instead.
    """
    from flwr.superlink.grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return
    deadline, count, since = time.monotonic() + NODES_SETTLE_S, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(list(grid.get_node_ids()))
        if now != count:
            count, since = now, time.monotonic()
        elif count > 0 and time.monotonic() - since >= 1.0:
            break
        time.sleep(0.1)
    wanted = config.train.num_clients
    if count != wanted:
        fit = min(config.train.clients_per_round, max(count, 1))
        raise FederationSizeError(
            f"the federation has {count} simulated SuperNodes and this run num_clients = "
            f"{wanted} (one SuperNode per client): run it with `flwr run . --federation-config "
            f"num-supernodes={wanted}`, or size the run to the federation with -c "
            f"\"num_clients={max(count, 1)} clients_per_round={fit}\"")


#: What the ServerApp under ``flwr run`` reports in one line (the user's to fix), not with a
#: traceback; the run still fails.
USER_ERRORS = (SettingsError, PreflightError, FederationSizeError, RunFolderError,
               NothingAggregatedError, CheckpointError, NoClientsError)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .`` entry: the run config holds the RunConfig keys (see docs/federation.md).

    A bad value, a federation of the wrong size, a run refused before its first round: one
    line on the run's log (:func:`fedgc.flower_log.report_once`) and a failed run.
    """
    drop_noise()
    try:
        config = RunConfig.from_flat(dict(context.run_config))
        check_federation(grid, config)
        run_server(grid, config)
    except USER_ERRORS as ex:
        report_once(ex)
        raise
