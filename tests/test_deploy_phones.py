"""``deploy --phones``: reference phones behind their own links beside SuperNodes behind theirs.

One run through the command line: a SuperNode on an LTE link (tbf and the proxy in a network
namespace, or the proxy alone without root) and a reference phone on its own LTE link to the
phone bridge (``python -m android_bridge serve``, TLS), whose SuperNode sits beside the
SuperLink. The phone is the emulated arm64 one of ``make arm`` when its rootfs is built (and
must be under ``make test``, FEDGC_ARM_REQUIRED=1), this machine's CPU otherwise. The bad
options are refused before anything starts.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from simulations.deploy.cli import main
from tests.conftest import PHONE_RUN


def _phone_arch() -> str:
    from android_bridge.arm.emulator import ArmEnv, ArmEnvError

    try:
        ArmEnv.find()
        return "arm64"
    except ArmEnvError:
        if os.environ.get("FEDGC_ARM_REQUIRED") == "1":
            raise
        return "host"


def _deploy_with_phones(export: Path, tmp_path: Path, phones: int, run_name: str,
                        *keys: str) -> tuple[Path, str]:
    """``deploy`` of one SuperNode and ``phones`` phones on LTE links with TLS, the phone run's
    keys plus ``keys`` (KEY=VALUE); the run's folder and what it printed."""
    argv = ["--nodes", "1", "--phones", str(phones), "--phone-arch", _phone_arch(),
            "--link", "lte", "--tls", "--phone-export", str(export),
            "--workdir", str(tmp_path / "work"),
            "--set", f"results_dir={tmp_path / 'results'}", "--set", f"run_name={run_name}"]
    for key, value in [*PHONE_RUN.items(), *(k.split("=", 1) for k in keys)]:
        argv += ["--set", f"{key}={value}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, out.getvalue()[-3000:]
    return tmp_path / "results" / run_name, out.getvalue()


@pytest.mark.slow
def test_deploy_mixes_a_phone_behind_its_link_with_a_supernode(digits_phone_export, tmp_path):
    arch = _phone_arch()
    run, text = _deploy_with_phones(digits_phone_export, tmp_path, 1, "mixed",
                                    "rounds=2", "round_timeout_s=600")
    record = json.loads((run / "deploy.json").read_text())
    # Client 0 is the SuperNode, client 1 the phone: both aggregated in both rounds.
    rows = list(csv.DictReader((run / "clients.csv").open()))
    assert sorted((int(r["round"]), int(r["client_key"])) for r in rows
                  if r["status"] == "aggregated") == [(1, 0), (1, 1), (2, 0), (2, 1)]
    phone = record["phones"]["1"]
    assert phone["arch"] == arch and phone["machine"] == ("aarch64" if arch == "arm64"
                                                          else os.uname().machine)
    assert [r["round"] for r in phone["rounds"]] == [1, 2]
    assert all(r["ack"] == "DELIVERED" for r in phone["rounds"])
    # The phone's payload is what the server counted for client 1: its update and its signs.
    sent = {int(r["round"]): int(r["uplink_bytes"]) for r in rows if r["client_key"] == "1"}
    assert sent == {r["round"]: r["uplink_bytes"] for r in phone["rounds"]}
    assert phone["rounds"][1]["signs_bytes"] > 0 and phone["rounds"][1]["encoding"] == "patch"
    # Both links carried the node's bytes and more; the bridge's SuperNode has none.
    link, phone_link = record["links"]["0"], record["phone_links"]["1"]
    assert record["links"]["1"] is None and record["phone_tls"] is True
    assert phone_link["uplink_bytes"] > sum(sent.values()) and link["uplink_bytes"] > 0
    assert phone_link["downlink_bytes"] > sum(r["downlink_bytes"] for r in phone["rounds"])
    assert f"phone ({arch})" in text and "link up kB" in text
    # Nothing of the run is left: no phone, bridge, SuperNode or app process names its folder.
    from simulations.deploy.processes import process_args

    work = str(tmp_path / "work")
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()
            and any(work in arg for arg in process_args(int(pid)))]
    assert left == []


@pytest.mark.slow
def test_deploy_runs_async_with_phones(digits_phone_export, tmp_path):
    """Issue 37: ``deploy --phones`` with ``mode = async``: a SuperNode and two reference
    phones, C = 3 (every client in the first fill, all on version 0), K = 2 (a step needs two
    clients, so the SuperNode cannot make the steps alone), 4 steps."""
    arch = _phone_arch()
    run, _ = _deploy_with_phones(digits_phone_export, tmp_path, 2, "async", "mode=async",
                                 "async.concurrency=3", "async.buffer=2", "rounds=4",
                                 "round_timeout_s=600")
    record = json.loads((run / "deploy.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    steps = list(csv.DictReader((run / "rounds.csv").open()))
    rows = list(csv.DictReader((run / "clients.csv").open()))
    assert summary["rounds"] == 4 and [int(r["round"]) for r in steps] == [1, 2, 3, 4]
    assert all(0.0 < float(r["accuracy"]) <= 1.0 for r in steps)
    # Two replies a step, every one aggregated (nothing stale beyond the bound, nothing lost).
    assert all(r["status"] == "aggregated" for r in rows), rows
    assert sorted(int(r["round"]) for r in rows) == [1, 1, 2, 2, 3, 3, 4, 4]
    # Every client was sent version 0 in the first fill: its first reply, applied at step t,
    # is t - 1 steps stale, a phone's as a SuperNode's. Two of the three wait past step 1.
    first: dict[int, dict[str, str]] = {}
    for r in sorted(rows, key=lambda r: int(r["round"])):
        first.setdefault(int(r["client_key"]), r)
    assert sorted(first) == [0, 1, 2], rows  # both phones were aggregated
    assert all(int(r["staleness"]) == int(r["round"]) - 1 for r in first.values()), rows
    assert any(int(r["staleness"]) > 0 for r in rows)
    for key in (1, 2):
        phone = record["phones"][str(key)]
        assert phone["arch"] == arch
        # A phone's tasks are dispatches, of increasing sequence, the first the first fill's.
        seqs = [t["round"] for t in phone["rounds"]]
        assert seqs == sorted(set(seqs)) and seqs[0] == 1, phone
        assert all(t["ack"] == "DELIVERED" for t in phone["rounds"])
        # What the server aggregated from the phone is what the phone sent (the run may end
        # before a reply the phone delivered is taken: those are left out).
        sent = sorted(t["uplink_bytes"] for t in phone["rounds"])
        counted = sorted(int(r["uplink_bytes"]) for r in rows if int(r["client_key"]) == key)
        assert counted and len(sent) - len(counted) in (0, 1), (sent, counted)
        assert not Counter(counted) - Counter(sent), (sent, counted)
        # Its link carried its payload and more (TLS, gRPC, the bridge's framing).
        link = record["phone_links"][str(key)]
        assert link["uplink_bytes"] > sum(sent)
        assert link["downlink_bytes"] > sum(t["downlink_bytes"] for t in phone["rounds"])
    assert record["links"]["0"]["uplink_bytes"] > 0 and record["phone_tls"] is True


@pytest.mark.parametrize("argv,message", [
    (["--phones", "1", "--app", "probe"], "--phones is for the fedgc app"),
    (["--phones", "-1"], "--phones -1: expected 0 or more"),
    (["--phones", "1", "--set", "num_clients=5"],
     "num_clients=5 but --nodes \\+ --phones = 3"),
    (["--phones", "1", "--set", "method=dense"], "method 'dense' is not served by phones"),
    # (dgc_sets' switches, which phones run since issue 39: not named)
    (["--phones", "1", "--set", "dgc.step_ahead=0.5", "--set", "dgc.value_levels=4",
      "--set", "dgc.shared_rank=displacement", "--set", "dgc.shared_first=true"],
     "error: dgc.step_ahead=0.5: phones run dgc's default client"),
    # Named for what phones lack, not for the method, whichever method the run names.
    (["--phones", "1", "--set", "method=dgc_sets", "--set", "privacy.secagg=true"],
     "privacy.secagg = true: phones behind the bridge do not run secure aggregation .*no "
     "X25519 key agreement"),
    (["--phones", "1", "--set", "privacy.secagg=true"], "phones behind the bridge do not run "
     "secure aggregation .*; phones run topk, randk, dgc, dgc_sets, tcs, qsgd, efsign, "
     "signvote\\)"),
])
def test_bad_phone_options_are_refused_before_anything_starts(argv, message, tmp_path,
                                                              capsys):
    import re

    work = tmp_path / "work"
    assert main([*argv, "--workdir", str(work), "--set",
                 f"results_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
    assert not (work / "phones" / "bridge").exists()
    assert not Path(tmp_path / "r").exists() or not any(Path(tmp_path / "r").iterdir())
