"""fedgc.settings: one engine for every run key (netem's too); dgc.* ranges from DGCConfig."""

from __future__ import annotations

import pytest

from dgc import DGCConfig
from dgc.errors import ConfigError
from fedgc.methods.dgc import DGCSettings, dgc_config
from fedgc.settings import (
    RunConfig,
    ServerSettings,
    SettingsError,
    TrainSettings,
    fields_of,
    key_table,
    method_key_classes,
    setting,
)
from simulations.cli import main
from simulations.netem.settings import NetemSettings

#: Run keys that set a DGCConfig field of the same range (the name on DGCConfig's side).
DGC_FIELDS = {"density": "density", "dgc.momentum": "momentum",
              "dgc.dampening": "dampening", "dgc.warmup_rounds": "warmup_epochs",
              "dgc.selection": "selection", "dgc.value_dtype": "value_dtype",
              "dgc.min_sparse_numel": "min_sparse_numel"}


def test_keys_lists_every_key_with_its_part(capsys):
    assert main(["keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100  # the project's line length: a terminal reads it
    # A key's line starts at the margin; its description follows, indented.
    listed = {line.split()[0]: line.split()[1] for line in lines if not line.startswith(" ")}
    first = " ".join(line.strip() for line in
                     lines[1:next(i for i, line in enumerate(lines[1:], 1)
                                  if not line.startswith(" "))])
    assert lines[1].startswith("    ") and "weighted by num-examples" in first
    netem = {f.metadata["key"] for f in fields_of(NetemSettings)}
    assert len(netem) == 28 and all(listed[k] == "netem" for k in netem)
    assert listed["dgc.momentum"] == "dgc" and listed["sim.engine"] == "sim"
    assert listed["density"] == "client" and listed["server_momentum"] == "server"
    assert listed["lr"] == "client" and listed["rounds"] == "run" and listed["task"] == "run"
    assert listed["attack.kind"] == "attack" and listed["sim.device"] == "sim"
    from fedgc.methods import registered

    own = method_key_classes(registered())  # the registered methods' own keys
    every = {f.metadata["key"] for cls in (TrainSettings, ServerSettings, NetemSettings, *own)
             for f in fields_of(cls)}
    assert set(listed) == every
    # ... each listed under its prefix: the method's (the sparsifiers' shared ones under dgc).
    assert all(listed[f.metadata["key"]] == f.metadata["key"].split(".")[0]
               for cls in own for f in fields_of(cls))
    assert listed["dgc.small_density"] == "dgc" and listed["tcs.topk_share"] == "tcs"


def test_keys_lists_the_keys_of_a_prefix_or_a_part(capsys):
    def listed(*prefixes: str) -> list[str]:
        assert main(["keys", *prefixes]) == 0
        return [line.split()[0] for line in capsys.readouterr().out.splitlines()
                if not line.startswith(" ")]

    netem = sorted(f.metadata["key"] for f in fields_of(NetemSettings))
    assert listed("netem") == netem
    assert listed("dgc.shared") and all(k.startswith("dgc.shared") for k in listed("dgc.shared"))
    server = {f.metadata["key"] for f in fields_of(ServerSettings)}
    assert "aggregation" in listed("server") and set(listed("server")) <= server
    assert "rounds" in listed("run") and "rounds" not in listed("server")  # by owner (fedgc.keys)
    assert listed("netem", "rounds") == sorted([*netem, "rounds"])
    assert main(["keys", "netx"]) == 2
    err = capsys.readouterr().err
    assert "no key starts with 'netx'" in err and "netem" in err


def test_a_key_of_no_known_part_is_refused():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Orphan:
        x: int = setting(1, "x", "a key no part owns")

    with pytest.raises(SettingsError, match="names no part"):
        key_table([Orphan])


@pytest.mark.parametrize(("key", "name"), sorted(DGC_FIELDS.items()))
def test_dgc_keys_take_their_range_from_dgc_config(key, name):
    check = next(f.metadata["check"] for cls in (TrainSettings, DGCSettings)
                 for f in fields_of(cls) if f.metadata["key"] == key)
    assert check == DGCConfig.check(name)


def test_clip_norm_is_dgc_configs_range_plus_zero_for_off():
    check = next(f.metadata["check"] for f in fields_of(DGCSettings)
                 if f.metadata["key"] == "dgc.clip_norm")
    assert check.accepts(0.0) and not DGCConfig.check("clip_norm").accepts(0.0)
    assert dgc_config(RunConfig().train, DGCSettings(clip_norm=0.0)).clip_norm is None
    with pytest.raises(SettingsError, match=r"dgc.clip_norm = -1.0 .*\[0, inf\)"):
        DGCSettings(clip_norm=-1.0)
    with pytest.raises(SettingsError, match=r"dgc.clip_norm = -1.0 .*\[0, inf\)"):
        RunConfig.from_flat({"dgc.clip_norm": -1.0})
    with pytest.raises(ConfigError, match="clip_norm must be a number in \\(0, inf\\)"):
        DGCConfig(clip_norm=0.0)


@pytest.mark.parametrize(("values", "match"), [
    ({"intermittent": 1.5}, r"netem.intermittent = 1.5 is outside the accepted range \[0, 1\]"),
    ({"deadline_s": float("inf")}, r"netem.deadline_s = inf"),
    ({"outage_policy": "drop"}, r"netem.outage_policy .*one of \['resume', 'fail'\]"),
    ({"stale_decay": 0.0}, r"netem.stale_decay = 0.0 .*\(0, 1\]"),
    ({"seed": "x"}, "netem.seed must be an integer, got 'x'"),
    ({"device_mix": "midrange:0.5"}, "netem.device_mix must be fractions"),
])
def test_netem_values_are_settings_errors_naming_key_and_range(values, match):
    with pytest.raises(SettingsError, match=match):
        NetemSettings(**values)
    with pytest.raises(SettingsError, match=match):
        NetemSettings.from_config({f"netem.{k}": v for k, v in values.items()})


def test_netem_strings_convert_like_every_key():
    s = NetemSettings.from_config({"netem.enabled": "true", "netem.seed": "4",
                                   "netem.deadline_s": "30"})
    assert s.enabled is True and s.seed == 4 and s.deadline == 30.0
    assert NetemSettings(seed="4") == NetemSettings(seed=4)  # type: ignore[arg-type]


def test_a_misspelt_key_is_named_with_the_key_it_resembles(capsys):
    assert main(["run", "--set", "dgc.shared_densty=0", "--set", "colour=blue"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m simulations run: error: unknown configuration keys 'colour', "
                   "'dgc.shared_densty' (did you mean 'dgc.shared_density'?); `python -m "
                   "simulations keys` lists every key")
    # A key without its prefix is named with it; the emulator's keys are suggested too.
    assert main(["run", "--set", "shared_density=0.1"]) == 2
    assert "'shared_density' (did you mean 'dgc.shared_density'?)" in capsys.readouterr().err
    assert main(["run", "--set", "netem.deadline=30"]) == 2
    assert "'netem.deadline' (did you mean 'netem.deadline_s'?)" in capsys.readouterr().err
