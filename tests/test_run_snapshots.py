"""Two fixed-seed runs on the in-process engine reproduce their committed results.

The snapshots in ``tests/golden/runs/`` were taken before the redesign of the strategy, the
settings and the wire code (issue 13), which must change no result. Where this machine's float
kernels are those the snapshots' values were taken with (``tests.run_compare.same_kernels``, a
probe of pure PyTorch: an AMD EPYC with AVX2 and torch 2.13, ``float_probe.json``), every
column of ``rounds.csv`` and ``clients.csv`` and every key of ``summary.json`` is compared
exactly, except what measures the machine (wall and compute seconds). On another CPU (issue 35:
an Intel Xeon with AVX-512 moved ``train_loss`` in its 9th digit, and a run parts from the
snapshot once a top-k selection flips) what no float decides (rounds, clients, partitions,
statuses, the config) is still compared exactly, and each float-dependent column within 2 to 3
times what another machine's kernels were measured to move it by
(``tests.run_compare.TOLERANCES``: accuracy 0.02, loss 5%, a client's uplink bytes 35%...).
``virtual_seconds`` is compared to 2e-3 relative everywhere: a reply carries its measured
compute seconds, and the emulator charges the reply's encoded size, so two runs of the same code
differ by up to ~1e-3 s in a round.

The values were taken again on 2026-12-06 (issue 35) on the AMD EPYC above, with
``tests/golden/runs/retake_values.py`` (the files' columns and keys kept, the values of this
code's runs, which equalled the earlier values bit for bit on the machine they were taken on:
``make test`` of that day); the earlier values differ from them by what
``tests.run_compare.TOLERANCES`` notes.

Since issue 29 the emulator's four columns come from its extension of the server's records
(``server.extensions``): a run without the emulator no longer writes them (they were all 0), and
a run with it writes them after the server's own columns. One key per setting for every method
replaced the per-method copies of the run config (:data:`RENAMED`, the values a run recorded).
Edited once since, by hand, on 2026-12-04: the stragglers that came in time after the K-th
(over-selection's surplus) moved from ``dropped_deadline`` to a new column, ``clients_surplus``;
every other value is as it was. Edited again on 2026-12-04 for issue 30, in
``netem_drop``'s ``virtual_seconds`` only (each round's and the total), taken from a run of
the code after, whose every other value is the snapshot's: every train message's config
carries issue 30's seven dgc client keys (``dgc.shared_values`` ... ``dgc.step_ahead``, ~230
bytes; a run's own method's keys all travel, :attr:`fedgc.settings.RunConfig.own`), which the
emulator charges on the client's downlink, ~4 ms a round on these links (33 ms in round 6).

Since issue 25 a train message names the run's config by its digest once the client holds it
(the config travels whole on a client's first contact only), and a reply carries only the
metrics the server reads: the emulator charges smaller messages, so ``netem_drop``'s
``virtual_seconds`` (each round's and the total) were taken again the same way, from a run of
the code with both issue 30's keys and issue 25's digest, whose every other value is the
snapshot's. Its wire and energy columns are not compared.

Issue 39's dgc client keys (``dgc.budget``, ``dgc.compact_wire``, ``dgc.server_error``, off)
travel in every train message's config too: ``netem_drop``'s ``virtual_seconds`` (each round's
and the total; 3-5 ms a round more) were taken again on 2026-12-06 from a run of the code with
them, whose every other value is the snapshot's.

Since issue 26 a simulation's defaults are plain FedAvg (:data:`CHANGED_DEFAULTS`), which
changes no value of these runs (its attack keys travel only in a run with hostile clients).

Since issue 37 (2026-12-07) every train message's config carries the ``unaggregated`` keys (the
runs set ``unaggregated = keep``, what every client did before), which the emulator charges on
the client's downlink: ``netem_drop``'s ``virtual_seconds`` (each round's, 3-5 ms more, and the
total) were taken again from a run of the code after, every other value being the snapshot's.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from simulations.cli import main
from simulations.netem.wire_columns import CLIENT_COLUMNS, ROUND_COLUMNS
from tests.run_compare import close, same_kernels

pytestmark = pytest.mark.cross_cpu

GOLDEN = Path(__file__).parent / "golden" / "runs"

# The downlink and layer keys as they were when the snapshots were taken (the defaults changed
# in issue 19).
COMMON = ["--set", "task=digits", "--set", "sim.engine=local", "--set", "progress=false",
          "--set", "rounds=6", "--set", "downlink_history=1", "--set", "downlink_density=1",
          "--set", "downlink_values=float16", "--set", "clients_build_initial_model=false",
          "--set", "dgc.small_density=0.1", "--set", "dgc.warmup_rounds=4",
          "--set", "dgc.min_sparse_numel=1024", "--set", "dgc.sparse_vectors=false",
          # Unaggregated updates folded back whole, as every client did then (issue 37's
          # default for dgc decays them).
          "--set", "unaggregated=keep"]
RUNS = {
    # DGC with the int8 compressed broadcast (patches of differences, look-ahead).
    "dgc_int8": ["--set", "num_clients=20", "--set", "clients_per_round=5", "--set", "seed=3",
                 "--set", "downlink_values=int8", "--set", "downlink_density=0.07"],
    # The emulator with half the clients intermittent: deadline and link drops, fold-backs.
    "netem_drop": ["--set", "num_clients=16", "--set", "clients_per_round=4",
                   "--set", "over_selection=1.5", "--set", "seed=5",
                   "--set", "density=0.05", "--set", "netem.enabled=true",
                   "--set", "netem.mix=3g:0.5,edge:0.5", "--set", "netem.intermittent=0.5",
                   "--set", "netem.deadline_s=30", "--set", "netem.protocol=none"],
}
MACHINE = {"wall_seconds", "compute_seconds_max", "compute_seconds", "process_seconds",
           # The transport's name for a node, not a result: Ray draws new ones every run, and
           # the in-process grid computes them from the partition id since issue 28.
           "node_id"}
CLOSE = {"virtual_seconds", "virtual_seconds_to_target"}
#: Config keys of where and what a run writes, not what it computes (tensorboard came later).
RUN_FOLDER = {"results_dir", "run_name", "state_dir", "tensorboard"}
#: Keys added after the snapshots, with the value that computes what the code did before them.
ADDED_LATER = {"dgc.server_lr": 1.0, "sim.device": "cpu", "sim.gpus_per_client": 0.0,
               # issue 30's switches, off
               "dgc.shared_values": "sign", "dgc.shared_levels": 1.0, "dgc.shared_first": False,
               "dgc.value_levels": 0.0, "dgc.residual_decay": 1.0,
               "dgc.residual_after_rounds": 0, "dgc.step_ahead": 0.0,
               "dgc.feedback": "residual", "dgc.feedback_scale": 0.0, "dgc.feedback_history": 50,
               "dgc.shared_rank": "aggregates", "dgc.shared_churn": 1.0,
               "downlink_deadband": 0.5, "downlink_vectors": "float32",
               "downlink_context": False,
               # issue 39's switches, off
               "dgc.budget": "tensor", "dgc.compact_wire": False, "dgc.server_error": 0.0,
               "downlink_compact": False,
               "client_nodes": "", "robust": "off", "clip_radius": 1.0, "clip_iterations": 3,
               "root_samples": 100, "attack.clients": "", "attack.kind": "sign_flip",
               "attack.norm_ratio": 10.0, "attack.weight_ratio": 4.0,
               "attack.target_class": 0,
               # issue 35: the colluding attacks' keys, and the direction gate (off: robust = off)
               "attack.deviation": "std", "attack.epsilon": 0.0, "attack.knowledge": "partial",
               "min_cosine": -1.0, "bucket_size": 1, "gate_reference": "trend",
               "gate_memory": 0.0, "clip_radius_clean": 0.0, "gate_memory_below": 0.0,
               "gate_first_bar": -1.0,
               # issue 37's fold-back of unaggregated updates, whole
               "unaggregated": "keep", "unaggregated_decay": 0.5, "unaggregated_cap": 1.0,
               # issue 37's asynchronous mode (off: sync), issue 38's privacy (off)
               "mode": "sync", "async.buffer": 5, "async.concurrency": 10,
               "async.max_staleness": 20, "async.staleness": "polynomial",
               "async.staleness_exponent": 0.75,
               "privacy.accountant": "rdp", "privacy.clip": 0.0, "privacy.delta": 1e-05,
               "privacy.clip_quantile": 0.0, "privacy.clip_learning_rate": 0.2,
               # dgc_sets' sets under secure aggregation (issue 38; no effect without it)
               "dgc.secure_density": 0.2, "dgc.shared_explore": "",
               "privacy.dp": "off", "privacy.neighbours": 0, "privacy.noise_multiplier": 1.0,
               "privacy.secagg": False, "privacy.value_bits": 16, "privacy.value_range": 0.0,
               "privacy.update_clip": 1.0}
#: Defaults a simulation changed since (issue 26: robust = off is plain FedAvg, no weight cap
#: and no norm clip), with the value the snapshots recorded. They cannot move these results: no
#: client of the snapshots was capped or clipped (asserted on their clients.csv).
CHANGED_DEFAULTS = {"max_weight_ratio": (4.0, 0.0), "max_norm_ratio": (10.0, 0.0)}
#: The emulator's keys added after the snapshots (issue 25), with the values that compute what
#: it did before them: no protocol model, the preset power models. Since issue 37 a profile
#: is charged by default (``bridge-tls``): ``netem_drop`` names ``none``, the default of its
#: time, and the profile's part keys are left to the profile (""). Issue 37's compute scale
#: (2026-12-07) is derived from the model: 1 for digits' MLP, the presets' charge as before.
NETEM_ADDED_LATER = {"netem.power_model": "", "netem.protocol": "none",
                     "netem.poll_interval_s": "", "netem.app_startup_s": "",
                     "netem.server_measured": "", "netem.server_s": "",
                     "netem.server_eval": False, "netem.compute_scale": 1.0}
#: The network emulator's columns: its extension's since issue 29, absent without it.
EMULATOR = ["virtual_seconds", "dropped_deadline", "dropped_link", "dropped_rejected"]
#: Added by the emulator's wire and energy extension (issue 25) after the snapshots, after its
#: other columns: not compared (the snapshots do not have them).
#: Issue 29's one key per setting: (new key, the retired key whose value a dgc run read), and
#: the retired keys no dgc run read.
RENAMED = [("server_momentum", "dgc.server_momentum"), ("server_lr", "dgc.server_lr"),
           ("density", "dgc.density")]
RETIRED = ["stc.density", "stc.downlink_density"]


def _same(scope: str, key: str, got: str | float, want: str | float) -> bool:
    if key in CLOSE and got is not None and want is not None:
        g, w = float(got), float(want)
        return math.isclose(g, w, rel_tol=2e-3) or (math.isnan(g) and math.isnan(w))
    return close(scope, key, got, want, exact=same_kernels())


def _compare_csv(got: Path, want: Path, emulated: bool) -> None:
    with got.open() as fh:
        rows = list(csv.DictReader(fh))
    with want.open() as fh:
        golden = list(csv.DictReader(fh))
    assert len(rows) == len(golden)
    columns = [c for c in golden[0] if c not in EMULATOR]
    if got.name == "rounds.csv" and not emulated:
        assert all(float(g[c]) == 0 for g in golden for c in EMULATOR)
        golden = [{c: g[c] for c in columns} for g in golden]
    elif got.name == "rounds.csv":
        columns += EMULATOR + list(ROUND_COLUMNS)  # after the server's own columns
    elif emulated:
        columns += list(CLIENT_COLUMNS)
    assert list(rows[0]) == columns, f"{got.name}: columns changed"
    for i, (r, g) in enumerate(zip(rows, golden, strict=True)):
        scope = got.name.removesuffix(".csv")
        diff = {k: (r[k], g[k]) for k in g
                if k not in MACHINE and not _same(scope, k, r[k], g[k])}
        assert not diff, f"{got.name} row {i + 1}: {diff}"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fixed_seed_run_matches_its_snapshot(name: str, tmp_path: Path) -> None:
    argv = ["run", *COMMON, *RUNS[name], "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}"]
    assert main(argv) == 0
    out, golden = tmp_path / name, GOLDEN / name
    emulated = "netem.enabled=true" in RUNS[name]
    _compare_csv(out / "rounds.csv", golden / "rounds.csv", emulated)
    _compare_csv(out / "clients.csv", golden / "clients.csv", emulated)
    got = json.loads((out / "summary.json").read_text())
    want = json.loads((golden / "summary.json").read_text())
    for doc in (got, want):
        for k in RUN_FOLDER:
            doc["config"].pop(k, None)
    for k, before in ADDED_LATER.items():
        assert k not in want["config"]
        want["config"][k] = before
    reasons = (golden / "clients.csv").read_text()
    assert "capped" not in reasons and "clipped" not in reasons
    for k, (recorded, now) in CHANGED_DEFAULTS.items():
        assert want["config"][k] == recorded
        want["config"][k] = now
    for new, old in RENAMED:
        want["config"][new] = want["config"].pop(old)
    for old in RETIRED:
        want["config"].pop(old)
    want["config"] = dict(sorted(want["config"].items()))
    if "netem" in want:
        want["netem"] = dict(sorted({**want["netem"], **NETEM_ADDED_LATER}.items()))
        got["netem"] = dict(sorted(got["netem"].items()))
    assert "label" in got and got.pop("label") == got["method"]
    diff = {k: (got.get(k), v) for k, v in want.items()
            if k not in MACHINE and not _same("summary", k, got.get(k), v)}
    assert not diff, f"summary.json: {diff}"
