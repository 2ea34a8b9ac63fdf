"""The real fedgc ServerApp and ClientApp on the deployment engine, with faults.

Every test drives real ``flower-superlink`` / ``flower-supernode`` processes over shaped links;
they are slow (the ClientApp starts a fresh process, importing torch, for every message).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from client.state import ClientStateStore
from server.checkpoint import load_checkpoint
from simulations.deploy.cli import main
from simulations.deploy.cluster import Deployment
from simulations.deploy.fedgc_run import deploy_run_config, finish_fedgc, submit_fedgc
from simulations.deploy.presets import preset

pytestmark = pytest.mark.slow

BASE: dict[str, object] = {"task": "digits", "rounds": 2, "round_timeout_s": 120.0, "seed": 0}
ROUND_COLUMNS = {"round", "accuracy", "loss", "uplink_bytes", "downlink_bytes", "clients_sampled",
                 "clients_aggregated", "clients_failed", "wall_seconds"}
SUMMARY_KEYS = {"method", "final_accuracy", "rounds", "uplink_bytes", "downlink_bytes",
                "dense_uplink_bytes", "uplink_compression", "wall_seconds"}


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
              poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def _stored_round(store: ClientStateStore, key: int) -> int:
    """The round of the latest reply client ``key`` stored (0 before its first)."""
    record = store.get(str(key))
    return int(record["reply"]["sequence"]) if record and "reply" in record else 0


def _rounds_done(run_dir: Path) -> int:
    path = run_dir / "rounds.csv"
    return len(_rows(path)) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run through the command line: 2 SuperNodes on LTE links, TLS and
    node authentication (client keys bound to the authenticated node ids)."""
    root = tmp_path_factory.mktemp("reference")
    argv = ["--nodes", "2", "--link", "lte", "--auth", "--workdir", str(root / "work"),
            "--set", f"results_dir={root / 'results'}", "--set", "run_name=ref"]
    for key, value in BASE.items():
        argv += ["--set", f"{key}={value}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    (root / "results" / "ref" / "stdout.txt").write_text(out.getvalue())
    return root / "results" / "ref"


def test_cli_runs_fedgc_and_writes_the_results_of_a_simulation_run(reference: Path) -> None:
    rounds = _rows(reference / "rounds.csv")
    assert ROUND_COLUMNS <= set(rounds[0])
    assert [int(r["round"]) for r in rounds] == [1, 2]
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rounds)
    assert all(int(r["clients_aggregated"]) == 2 for r in rounds)
    summary = json.loads((reference / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["rounds"] == 2 and summary["uplink_compression"] > 1.0
    assert summary["uplink_bytes"] == sum(int(r["uplink_bytes"]) for r in rounds)
    record = json.loads((reference / "deploy.json").read_text())
    assert record["status"] == "finished:completed" and record["auth"] is True
    # Deployed clients are not trusted: robust = auto is on (docs/threat_model.md).
    assert summary["config"]["robust"] == "on"
    assert summary["config"]["aggregation"] == "centered_clip"
    bound = summary["config"]["client_nodes"].split(",")
    assert [item.split(":")[0] for item in bound] == ["0", "1"]
    assert record["shaping_mode"] in ("netem", "tbf", "proxy")
    # The encoded updates really crossed the shaped links (plus Flower's own messages).
    uplink_through_links = sum(link["uplink_bytes"] for link in record["links"].values())
    assert uplink_through_links >= summary["uplink_bytes"]
    # ... and the printed table says so, beside the payload.
    printed = (reference / "stdout.txt").read_text().splitlines()
    row = next(ln for ln in printed if ln.startswith("uplink "))
    assert row.split()[1:3] == [f"{summary['uplink_bytes'] / 1e6:.3f}",
                                f"{uplink_through_links / 1e6:.3f}"]
    assert (reference / "model.pt").is_file()
    assert list(reference.glob("*.png"))


def test_serverapp_killed_mid_run_resumes_from_its_checkpoint(
    reference: Path, deployment: Callable[..., Deployment], tmp_path: Path
) -> None:
    dep = deployment(nodes=2, link=preset("lte"))
    config = deploy_run_config(
        {**BASE, "results_dir": str(tmp_path / "results"), "run_name": "crash"}, 2
    )
    run_id = submit_fedgc(dep, config)
    _wait_for(lambda: _rounds_done(config.run_dir) >= 1, 400, "round 1 of the run to crash")
    assert dep.kill_serverapp() == 1
    dep.stop_run(run_id)

    logged = {i: len(node.log_text(since_start=False)) for i, node in dep.supernodes.items()}
    resumed = config.with_overrides({"resume": True})
    run = finish_fedgc(dep, resumed, submit_fedgc(dep, resumed, "1.0.1"), 400)
    assert run.result.ok, run.result.log[-3000:]
    assert re.search(r"Resumed from .* after round 1", run.result.log)
    assert [int(r["round"]) for r in _rows(config.run_dir / "rounds.csv")] == [1, 2]

    final = torch.load(config.run_dir / "model.pt")
    expected = torch.load(reference / "model.pt")
    errors = [r for r in _rows(config.run_dir / "clients.csv") if r["status"] != "aggregated"]
    assert errors == [], f"a re-sent round was not answered as before: {errors}"
    # The checkpoint holds the node id -> client key map: the resumed ServerApp messages the
    # same SuperNodes without an identification query (which used to go unanswered), and
    # samples both again.
    for i, node in dep.supernodes.items():
        assert "Receiving: query message" not in node.log_text(since_start=False)[logged[i]:]
    assert int(_rows(config.run_dir / "rounds.csv")[1]["clients_aggregated"]) == 2
    assert expected.keys() == final.keys()
    for k in expected:
        assert torch.equal(final[k], expected[k]), f"{k} differs from the uninterrupted run"


def _train_rounds(log: str) -> set[int]:
    """The rounds of the train messages a SuperNode's log shows it received (the round is the
    message's group id, logged on receipt)."""
    return {int(r) for r in re.findall(r"\[RUN \d+, ROUND (\d+)\]\s*\n.*Receiving: train message",
                                       log)}


def test_supernode_crash_and_an_intermittent_link_lose_no_update(
    deployment: Callable[..., Deployment], tmp_path: Path
) -> None:
    # Outages every ~8 s that reset every connection of node links (policy "fail").
    link = preset("lte").with_overrides(mean_online_s=8.0, mean_offline_s=1.0,
                                        outage_policy="fail")
    dep = deployment(nodes=2, link=link, seed=5, restart_on_exit=True)
    # A round deadline beyond the SuperLink's heartbeat patience (2 x 30 s): round 2 then ends
    # when the SuperLink declares the crashed node offline and answers its message with an
    # error, so round 3 starts without the dead node id and waits for the restarted node. With
    # a shorter deadline round 3 could still see the dead id online and send it round 3. No
    # longer than that: a round whose reply the link loses lasts the whole deadline.
    deadline_s = 120.0
    # Five rounds, so that the restarted node has two rounds in which to be served whatever
    # the crash's timing: the link may lose one of its replies (Flower's SuperNode does not
    # resend a reply whose push a reset broke; see docs/deploy.md, findings), and on a slow
    # machine (CI) the test process may kill the node only after its round-2 reply was sent:
    # round 2 then ends at once, and round 3 goes to the dead node id, still listed online.
    rounds = 5
    config = deploy_run_config(
        {**BASE, "rounds": rounds, "round_timeout_s": deadline_s,
         "results_dir": str(tmp_path / "r"), "run_name": "faults"}, 2
    )
    run_id = submit_fedgc(dep, config)
    store = ClientStateStore(config.state_dir)
    node = dep.supernodes[1]
    # Train messages carry their round as group id, which the SuperNode logs on receipt. (An
    # offset into the log taken once round 1 was stored raced: a starved test process could
    # take it after round 2 had arrived, and then killed the node in round 3.) The node is
    # killed as the first train message of round 2 or later reaches it: the link can lose a
    # pull (the SuperLink hands a message out once; seen under heavy load, round 2's never
    # arrived), and round 1 may last its whole deadline and more (a reply lost on the link).
    def received() -> set[int]:
        return {r for r in _train_rounds(node.log_text(since_start=False)) if r >= 2}

    _wait_for(lambda: bool(received()), 400 + 2 * (deadline_s + 120),
              "node 1 to receive a train message of round 2 or later", poll_s=0.05)
    crashed_id = dep.node_id(1)
    dep.kill_supernode(1)  # mid-round: its ClientApp is starting or training
    assert not node.group_alive()
    crash_round = max(received())  # the round it was in when killed
    assert crash_round < rounds, f"the link lost node 1's train messages of rounds 2-{rounds - 1}"
    # The crash comes as the message arrives, almost always before the reply is stored (then it
    # was never sent). A test process starved for the seconds a ClientApp takes to start and
    # train (seen in CI) kills it later: the reply may then be stored, and sent or not. Under
    # heavy load the client may also not have answered any earlier round (the link lost its
    # reply to round 1's identification query, so round 1 ran without it). Whatever the case,
    # no update may be lost or applied twice, which is what follows checks.
    answered = _stored_round(store, 1)
    assert 0 <= answered <= crash_round, (answered, crash_round)
    # Bring it back once the SuperLink has noticed (missed heartbeats), which also ends the
    # crash round.
    _wait_for(lambda: dep.node_statuses().get(crashed_id) != "online", 200,
              "the SuperLink to mark the crashed node offline", poll_s=3.0)
    restarted_at = len(node.log_text(since_start=False))
    dep.start_supernode(1)
    dep.wait_supernode(1, timeout_s=120)

    # The rounds left, each up to its deadline plus Flower's pull retries past it (up to ~110 s
    # seen), and an identification query of the restarted node (probe_timeout 120 s).
    run = finish_fedgc(dep, config, run_id, (rounds - 1) * (deadline_s + 120) + 180)
    assert run.result.ok, run.result.log[-3000:]
    clients = _rows(config.run_dir / "clients.csv")
    status = {(int(r["round"]), int(r["client_key"])): r["status"] for r in clients}
    reason = {(int(r["round"]), int(r["client_key"])): r["reason"] for r in clients}
    if answered < crash_round:
        # The crashed node's update of that round never arrived: the SuperLink ended the wait
        # (the node declared offline), or, on a loaded machine (make test's lanes at once), the
        # round's deadline came first.
        assert (status[(crash_round, 1)], "Node Unavailable" in reason[(crash_round, 1)]) in (
            ("error", True), ("timeout", False)), (status[(crash_round, 1)],
                                                   reason[(crash_round, 1)])
    else:  # stored, then sent or not: aggregated, or lost as above
        assert status[(crash_round, 1)] in ("aggregated", "error", "timeout"), \
            reason[(crash_round, 1)]
    # The restarted node is served again: the server messages its new node id (its log since
    # the restart shows a train message of a later round), and whatever came of those rounds
    # is what the link or the deadline made of them, never the ClientApp failing nor the
    # server refusing its reply. Its update is usually aggregated in a later round, but not
    # always: in CI (three lanes at once on 2 cores, 2026-12-07) client 1 went unsampled in
    # round 3 (1 client in a 224 s round: its identification query unanswered) and failed in
    # rounds 4 and 5 (216 s and 23 s; the reasons were not printed then, they are now). The
    # outage chain resets a connection every ~9 s, and Flower's SuperNode does not resend a
    # reply whose push a reset broke (docs/deploy.md, findings). Requiring an aggregated
    # update there made the test flaky; what fedgc owns is asserted: no reply lost to fedgc,
    # none applied twice, fold-backs right.
    later = _train_rounds(node.log_text(since_start=False)[restarted_at:])
    later_rows = {r: (status[(r, 1)], reason[(r, 1)]) for r in range(crash_round + 1, rounds + 1)
                  if (r, 1) in status}
    why = (f"crash in round {crash_round}, answered {answered}, client 1 after the restart: "
           f"{later_rows}, its log's rounds {sorted(later)}, restarts {dep.restarts}\n"
           f"{dep.log_tails([1])[-3000:]}")
    assert any(r > crash_round for r in later), why
    for state, text in later_rows.values():
        assert state in ("aggregated", "timeout", "error"), why
        # A ClientApp's own exception reads "<class '...'>:<'...'>" (flwr's run_clientapp).
        assert not text.startswith("<class ") and "load `ClientApp`" not in text, why
    aggregated = Counter((int(r["round"]), int(r["client_key"])) for r in clients
                         if r["status"] == "aggregated")
    assert max(aggregated.values()) == 1  # no update applied twice
    # A client folds back only an update the server never aggregated (else its mass would be
    # applied twice): the client's previous sampled round must not be aggregated.
    for row in clients:
        if row["status"] == "aggregated" and int(row["restored"]):
            key, r = int(row["client_key"]), int(row["round"])
            before = [rr for (rr, k) in status if k == key and rr < r]
            assert before and status[(max(before), key)] != "aggregated", row
    assert run.summary["clients_aggregated"] == sum(aggregated.values())
    stats = [nl.proxy.stats for nl in dep.node_links.values() if nl.proxy is not None]
    assert sum(s.outages for s in stats) >= 1
    assert sum(s.aborted_by_outage for s in stats) >= 1  # connections really were dropped


def test_async_runs_through_flowers_grpc_grid_and_resumes_after_a_killed_serverapp(
    deployment: Callable[..., Deployment], tmp_path: Path
) -> None:
    """Issue 37: ``mode = async`` in a deployment: the loop pushes and pulls through the
    SuperLink's gRPC grid (TLS), two SuperNodes behind LTE links train at once, a step per reply.
    The ServerApp is SIGKILLed after a step and resumed (``resume = true``) in the same
    deployment: the dispatch in flight at its checkpoint is sent again, and the run ends with
    every step applied once (docs/async.md, "Checkpoint and resume")."""
    dep = deployment(nodes=2, link=preset("lte"), tls=True)
    steps = 3
    config = deploy_run_config(
        {**BASE, "rounds": steps, "mode": "async", "async.concurrency": 2, "async.buffer": 1,
         "results_dir": str(tmp_path / "r"), "run_name": "async"}, 2
    )
    run_id = submit_fedgc(dep, config)
    # Three steps: the first two may come at once (both nodes trained on version 0), the third
    # needs a dispatch made after a step, a whole ClientApp's start-up and training later.
    _wait_for(lambda: _rounds_done(config.run_dir) >= 1, 400, "step 1 of the async run",
              poll_s=0.05)
    assert dep.kill_serverapp() == 1, "the run ended before the test could kill its ServerApp"
    dep.stop_run(run_id)
    # The checkpoint is written before rounds.csv: it may be one step ahead of the rows read.
    saved = load_checkpoint(config.run_dir)
    assert saved is not None
    at = int(saved["completed_rounds"])
    assert 1 <= at < steps, at
    # C = 2, K = 1: after a step one client is free, the other's dispatch is in flight.
    in_flight = [(int(d["key"]), int(d["sequence"])) for d in saved["async_loop"]["dispatches"]]
    assert len(in_flight) == 1, in_flight

    logged = {i: len(node.log_text(since_start=False)) for i, node in dep.supernodes.items()}
    resumed = config.with_overrides({"resume": True})
    run = finish_fedgc(dep, resumed, submit_fedgc(dep, resumed, "1.0.1"), 600)
    assert run.result.ok, run.result.log[-3000:]
    assert "asynchronous (FedBuff)" in run.result.log
    assert re.search(rf"Resumed from .* after round {at}\b", run.result.log)
    [(key, sequence)] = in_flight
    assert (f"sent again 1 dispatch(es) in flight at the checkpoint: client {key} "
            f"(dispatch {sequence})") in run.result.log, run.result.log[-3000:]
    # The node ids came back with the checkpoint: no identification query after the resume.
    for i, node in dep.supernodes.items():
        assert "Receiving: query message" not in node.log_text(since_start=False)[logged[i]:]
    # Every step applied once, from one reply each; no reply lost to an error or applied twice
    # (a re-sent dispatch its client had answered is answered with the same bytes, not trained
    # again: client/app.py).
    rounds = _rows(config.run_dir / "rounds.csv")
    assert [int(r["model_version"]) for r in rounds] == list(range(1, steps + 1))
    assert all(int(r["clients_aggregated"]) == 1 for r in rounds)
    clients = _rows(config.run_dir / "clients.csv")
    assert [(int(r["round"]), r["status"]) for r in clients] == [
        (step, "aggregated") for step in range(1, steps + 1)], clients
    assert {int(r["client_key"]) for r in clients} <= {0, 1}
    assert int(clients[0]["staleness"]) == 0
    assert run.summary["clients_aggregated"] == steps
