"""RunConfig: defaults are valid; bad keys and values stop with the key and the accepted range."""

import pytest

from server.config import RunConfig, SettingsError, flatten, load_toml


def test_defaults_and_round_trip():
    c = RunConfig()
    assert c.train.method == "dgc" and c.train.density == 0.001
    again = RunConfig.from_flat(c.to_flat())
    assert again == c
    assert c.with_overrides({"dgc.density": "0.01"}).train.density == 0.01


@pytest.mark.parametrize("values, words", [
    ({"dgc.densty": 0.1}, ["unknown", "dgc.densty", "dgc.density"]),
    ({"dgc.density": 0.0}, ["dgc.density", "(0, 1]"]),
    ({"dgc.density": 1.5}, ["dgc.density", "(0, 1]"]),
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
])
def test_bad_values_name_key_and_range(values, words):
    with pytest.raises(SettingsError) as info:
        RunConfig.from_flat(values)
    for w in words:
        assert w in str(info.value)


def test_strings_from_the_command_line_are_typed():
    c = RunConfig.from_flat({"rounds": "7", "dgc.momentum_correction": "false", "lr": "0.1",
                             "dgc.density": "1"})
    assert c.server.rounds == 7 and c.train.momentum_correction is False
    assert c.train.lr == 0.1 and c.train.density == 1.0


def test_toml_tables_flatten(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('rounds = 3\n[dgc]\ndensity = 0.01\n[sim]\nengine = "local"\n')
    assert flatten({"a": {"b": {"c": 1}}}) == {"a.b.c": 1}
    c = RunConfig.from_flat(load_toml(f))
    assert (c.server.rounds, c.train.density, c.server.engine) == (3, 0.01, "local")
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
    t = RunConfig.from_flat({"method": "topk"}).train.dgc_config()
    assert not t.error_feedback and not t.momentum_correction
    d = RunConfig.from_flat({"method": "dgc", "dgc.momentum": 0.5,
                             "dgc.dampening": 0.5}).train.dgc_config()
    assert d.error_feedback and d.momentum == 0.5 and d.dampening == 0.5
