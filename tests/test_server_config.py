"""RunConfig: defaults are valid; bad keys and values stop with the key and the accepted range."""

import pytest

from fedgc.methods.dgc import dgc_config
from fedgc.settings import ROBUST_PROFILES, RunConfig, SettingsError, flatten, load_toml


def test_defaults_and_round_trip():
    c = RunConfig()
    assert c.train.method == "dgc" and c.train.density == 0.001
    again = RunConfig.from_flat(c.to_flat())
    assert again == c
    assert c.with_overrides({"density": "0.01"}).train.density == 0.01


def test_defaults_are_the_researched_federated_settings():
    """docs/federated_momentum.md, section 5: error feedback only, more local work per round;
    issue 19: both directions compressed, the output layer at 0.03, no warm-up."""
    config = RunConfig()
    t, s, own = config.train, config.server, config.method.own
    assert (t.lr, t.local_epochs, t.batch_size, t.client_momentum) == (0.1, 2, 10, 0.5)
    assert (own.momentum_correction, own.momentum, own.small_density, own.small_numel) == \
        (False, 0.0, 0.03, 10_000)
    assert own.warmup_rounds == 0
    # The layer policy of issue 19: the LSTM's biases and embedding are sparsified, the CNN's
    # first convolution (16x1x5x5) and the MLP's biases are not.
    assert (own.min_sparse_numel, own.sparse_vectors) == (512, True)
    policy = config.method.compressor(t, 0).large.config
    assert not policy.sends_dense((512,)) and not policy.sends_dense((76, 8))
    assert policy.sends_dense((16, 1, 5, 5)) and policy.sends_dense((200,))
    assert (s.downlink_density, s.downlink_values, s.downlink_history,
            s.clients_build_initial_model) == (0.05, "int8", 1000, True)
    # Section 6: the shared sign channel and server momentum 0.5, dgc's default (dense FedAvg's
    # is 0).
    assert (own.shared_density, own.shared_small_density, own.shared_momentum) == (0.03, 0.0, 0.9)
    assert (s.server_lr, s.server_momentum) == (1.0, 0.5)
    dense = RunConfig.from_flat({"method": "dense"}).server
    assert (dense.server_lr, dense.server_momentum) == (1.0, 0.0)
    comp = config.method.compressor(t, 0)
    assert type(comp).__name__ == "TwoDensityCompressor" and comp.small_numel == 10_000
    assert comp.small.config.density == 0.03 and comp.large.config.density == 0.001
    assert comp.large.config.error_feedback and not comp.large.config.momentum_correction
    off_config = RunConfig.from_flat({"dgc.small_density": 0})
    off = off_config.method.compressor(off_config.train, 0)
    assert type(off).__name__ == "DGCCompressor"


@pytest.mark.parametrize("values, words", [
    ({"dgc.densty": 0.1}, ["unknown", "dgc.densty", "density"]),
    ({"density": 0.0}, ["density", "(0, 1]"]),
    ({"density": 1.5}, ["density", "(0, 1]"]),
    ({"rounds": -3}, ["rounds", "[1, inf)"]),
    ({"rounds": "ten"}, ["rounds", "integer"]),
    ({"rounds": 2.5}, ["rounds", "integer"]),
    ({"method": "fedprox"}, ["method", "dense", "topk", "dgc"]),
    ({"server_momentum": 1.0}, ["server_momentum", "[0, 1)"]),
    ({"lr": float("nan")}, ["lr"]),
    ({"checkpoint": "maybe"}, ["checkpoint", "boolean"]),
    ({"clients_per_round": 20, "num_clients": 10}, ["clients_per_round", "num_clients"]),
    ({"local_epochs": 0, "local_steps": 0}, ["local_epochs", "local_steps"]),
    ({"run_name": "../elsewhere"}, ["run_name"]),
    ({"sim.engine": "dask"}, ["sim.engine", "ray"]),
    ({"dgc.small_density": -0.1}, ["dgc.small_density", "[0, 1]"]),
    ({"dgc.small_density": 1.5}, ["dgc.small_density", "[0, 1]"]),
    ({"dgc.small_numel": 0}, ["dgc.small_numel", "[1, inf)"]),
    ({"dgc.small_numel": 10.5}, ["dgc.small_numel", "integer"]),
    ({"dgc.shared_density": 1.5}, ["dgc.shared_density", "[0, 1]"]),
    ({"dgc.shared_small_density": -0.5}, ["dgc.shared_small_density", "[0, 1]"]),
    ({"dgc.shared_momentum": 1.0}, ["dgc.shared_momentum", "[0, 1)"]),
    ({"server_momentum": -0.1}, ["server_momentum", "[0, 1)"]),
    ({"max_weight_ratio": -1}, ["max_weight_ratio", "[0, inf)"]),
    ({"max_norm_ratio": float("inf")}, ["max_norm_ratio"]),
    ({"aggregation": "krum"}, ["aggregation", "trimmed_mean", "median"]),
    ({"trim_fraction": 0.5}, ["trim_fraction", "[0, 0.5)"]),
])
def test_bad_values_name_key_and_range(values, words):
    with pytest.raises(SettingsError) as info:
        RunConfig.from_flat(values)
    for w in words:
        assert w in str(info.value)


def test_strings_from_the_command_line_are_typed():
    c = RunConfig.from_flat({"rounds": "7", "dgc.momentum_correction": "false", "lr": "0.1",
                             "density": "1"})
    assert c.server.rounds == 7 and c.method.own.momentum_correction is False
    assert c.train.lr == 0.1 and c.train.density == 1.0


def test_toml_tables_flatten(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('rounds = 3\ndensity = 0.01\n[dgc]\nmomentum = 0.5\n[sim]\nengine = "local"\n')
    assert flatten({"a": {"b": {"c": 1}}}) == {"a.b.c": 1}
    c = RunConfig.from_flat(load_toml(f))
    assert (c.server.rounds, c.train.density, c.server.engine) == (3, 0.01, "local")
    assert c.method.own.momentum == 0.5 and c.own["dgc.momentum"] == 0.5
    with pytest.raises(SettingsError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("rounds = = 3")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_toml(tmp_path / "bad.toml")


def test_every_key_is_documented():
    rows = RunConfig.describe()
    assert {r[0] for r in rows} == set(RunConfig.keys())
    assert all(r[4] for r in rows)


def test_topk_drops_residual_and_dgc_keeps_it():
    topk = RunConfig.from_flat({"method": "topk"})
    t = topk.method.config(topk.train)
    assert not t.error_feedback and not t.momentum_correction
    # topk splits the densities like dgc, so that the two differ only in the residual.
    k = topk.method.compressor(topk.train, 0)
    assert k.small.config.density == 0.03 and not k.small.config.error_feedback
    dgc = RunConfig.from_flat({"method": "dgc", "dgc.momentum": 0.5, "dgc.dampening": 0.5})
    d = dgc_config(dgc.train, dgc.method.own)
    assert d.error_feedback and d.momentum == 0.5 and d.dampening == 0.5


def test_docs_key_table_matches_the_schema():
    """docs/federation.md's key table is the schema's (regenerate it from RunConfig.describe)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "federation.md").read_text()
    rows = [f"| `{key}` | {kind} | `{default}` | {accepted} | {text} |"
            for key, kind, default, accepted, text in RunConfig.describe()]
    table = [line for line in doc.splitlines() if line.startswith("| `")]
    assert table == rows


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5])
def test_downlink_density_out_of_range_is_named(value):
    with pytest.raises(SettingsError, match=r"downlink_density.*\(0, 1\]"):
        RunConfig.from_flat({"downlink_density": value})


def test_the_defence_keys_reach_the_strategy():
    """max_weight_ratio, max_norm_ratio, aggregation, trim_fraction and the centered clip's
    keys are run-config keys that reach the strategy's defence and combine stages; left empty,
    robust fills them: off (simulation's default) is plain FedAvg, on the robust profile."""
    from server.strategy import DGCStrategy

    default = DGCStrategy(RunConfig.from_flat({}))
    assert (default.bounds.max_weight_ratio, default.bounds.max_norm_ratio) == (0.0, 0.0)
    assert default.combine.how == "mean"
    robust = DGCStrategy(RunConfig.from_flat({"robust": "on"}))
    profile = ROBUST_PROFILES["on"]
    assert (robust.bounds.max_weight_ratio, robust.bounds.max_norm_ratio) == (
        profile["max_weight_ratio"], profile["max_norm_ratio"])
    assert robust.combine.how == profile["aggregation"]
    s = DGCStrategy(RunConfig.from_flat({
        "robust": "on", "max_weight_ratio": 0, "max_norm_ratio": "2.5",
        "aggregation": "trimmed_mean", "trim_fraction": 0.2}))
    assert (s.bounds.max_weight_ratio, s.bounds.max_norm_ratio) == (0.0, 2.5)
    assert (s.combine.how, s.combine.trim_fraction) == ("trimmed_mean", 0.2)
    c = DGCStrategy(RunConfig.from_flat({"aggregation": "centered_clip", "clip_radius": 1.5,
                                         "clip_iterations": 2}))
    assert (c.combine.centered.radius_ratio, c.combine.centered.iterations) == (1.5, 2)
    m = DGCStrategy(RunConfig.from_flat({"robust": "on", "gate_memory": 0.9}))
    assert (m.combine.gate_memory, m.combine.gated) == (0.9, True)
    assert default.combine.gate_memory == 0.0  # the key's default: no record
    b = DGCStrategy(RunConfig.from_flat({"robust": "on", "gate_memory": 0.9,
                                         "gate_memory_below": -0.2}))
    assert (b.combine.memory_below, default.combine.memory_below) == (-0.2, 0.0)


def test_a_run_without_run_name_gets_a_new_folder(tmp_path, monkeypatch):
    """The default run_name: a folder named by time, task and method, never the last run's;
    a name taken (two runs in one second) gets a counter; a config carries its one name
    through overrides."""
    import re

    import fedgc.settings

    first = RunConfig.from_flat({"results_dir": str(tmp_path), "task": "digits"})
    assert re.fullmatch(r"\d{8}-\d{6}-digits-dgc", first.server.run_name)
    assert first.with_overrides({"rounds": 3}).run_dir == first.run_dir
    assert RunConfig.from_flat(first.to_flat()).run_dir == first.run_dir
    monkeypatch.setattr(fedgc.settings.time, "strftime", lambda _: "20261204-101502")
    names = []
    for _ in range(3):
        c = RunConfig.from_flat({"results_dir": str(tmp_path), "method": "dense"})
        c.run_dir.mkdir()
        names.append(c.server.run_name)
    assert names == ["20261204-101502-mnist5k-dense", "20261204-101502-mnist5k-dense-2",
                     "20261204-101502-mnist5k-dense-3"]
    named = RunConfig.from_flat({"results_dir": str(tmp_path), "run_name": "mine"})
    assert named.run_dir == tmp_path / "mine"


def test_resume_needs_the_run_name():
    with pytest.raises(SettingsError, match="resume=true needs run_name"):
        RunConfig.from_flat({"resume": True})
    assert RunConfig.from_flat({"resume": True, "run_name": "r"}).server.run_name == "r"


@pytest.mark.parametrize("old, new", [("dgc.density", "density"), ("stc.density", "density"),
                                      ("dgc.server_lr", "server_lr"),
                                      ("dgc.server_momentum", "server_momentum"),
                                      ("stc.downlink_density", "downlink_density")])
def test_a_retired_key_names_its_successor(old, new):
    with pytest.raises(SettingsError, match=rf"{old} is now {new} \(one key for every method\)"):
        RunConfig.from_flat({old: 0.5})


def test_each_method_has_its_own_defaults_for_the_shared_keys():
    """server_momentum: 0.5 for fedavgm and dgc, 0 for the others; STC's 1/400 both ways and
    its ternary broadcast; a value given applies to every method, and a comparison's next method
    gets its own default back (with_overrides)."""
    def keys(method, **given):
        c = RunConfig.from_flat({"method": method, **given})
        return (c.server.server_momentum, c.train.density, c.server.downlink_density,
                c.server.downlink_values)

    assert keys("dense") == keys("topk") == (0.0, 0.001, 0.05, "int8")
    assert keys("fedavgm") == keys("dgc") == (0.5, 0.001, 0.05, "int8")
    assert keys("stc") == (0.0, 0.0025, 0.0025, "ternary")
    assert keys("stc", server_momentum=0.3, density="") == (0.3, 0.0025, 0.0025, "ternary")
    stc = RunConfig.from_flat({"method": "stc", "downlink_values": "float16"})
    dgc = stc.with_overrides({"method": "dgc"})
    assert (dgc.server.server_momentum, dgc.train.density) == (0.5, 0.001)
    assert dgc.server.downlink_values == "float16"  # given, not the method's
    assert RunConfig().to_flat()["server_momentum"] == 0.5
