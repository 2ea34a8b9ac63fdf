"""A round's time from its causes: protocol profiles, their keys and files, the server's work
measured in the run (simulations.netem.protocol, settings, strategy)."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

from fedgc.settings import SettingsError
from simulations.cli import main
from simulations.netem.protocol import ProtocolModel, load_protocols
from simulations.netem.settings import DEFAULT_PROTOCOL, NetemSettings, profile_line


def _profile(**changes: object) -> dict:
    """The bridge's profile as a JSON object, with ``changes``."""
    spec = json.loads(Path("simulations/netem/protocols.json").read_text())["bridge-tls"]
    return {**spec, **changes}


def _write(path: Path, doc: object) -> str:
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def test_fedgc_profiles_name_their_orchestration_and_the_default_is_the_phone_bridge() -> None:
    models = load_protocols()
    assert DEFAULT_PROTOCOL == "bridge-tls" == NetemSettings().protocol
    bridge, node, devbox = (models[n] for n in ("bridge-tls", "supernode-tls",
                                                "supernode-tls-devbox"))
    # A phone's app is resident and long-polls; the server's time is measured in the run.
    assert (bridge.poll_interval_s, bridge.clientapp_startup_s, bridge.server_s) == (0, 0, 0)
    assert bridge.server_measured and bridge.rpcs_per_object == 0
    # A SuperNode polls every 3 s (Flower's constant), starts a process per message.
    assert node.poll_interval_s == 3.0 and node.clientapp_startup_s > 0
    assert node.server_measured and node.rpcs_per_object == 1 and node.clock_source
    # The development machine's fit of 2026-12-04, kept whole: its constants, nothing measured.
    assert (devbox.clientapp_startup_s, devbox.server_s) == pytest.approx((7.404, 8.509),
                                                                          abs=1e-3)
    assert not devbox.server_measured
    assert devbox.down_sent == node.down_sent  # the same wire fit
    line = profile_line(NetemSettings())
    assert line.startswith("bridge-tls:") and "resident app" in line and "measured" in line
    assert "payload only" in profile_line(NetemSettings(protocol="none"))


@pytest.mark.parametrize(("content", "message"), [
    (None, "neither 'none', a profile of fedgc's"),
    ("{not json", "not a JSON object of protocol profiles"),
    ('{"mine": {"rpcs_down_fixed": 1', "not a JSON object of protocol profiles"),
    ("[1, 2]", "expected a JSON object of profile name -> fields"),
    ({"mine": _profile(server_s=-1.0)}, "mine.server_s must be a number >= 0, got -1.0"),
    ({"mine": {k: v for k, v in _profile().items() if k != "clientapp_startup_s"}},
     "profile 'mine' lacks field 'clientapp_startup_s'"),
    ({"mine": _profile(startup_s=1.0)}, "profile 'mine' has unknown field 'startup_s'"),
    ({"mine": _profile(rpcs_up_fixed=1.5)}, "mine.rpcs_up_fixed must be an integer >= 0"),
    ({"mine": _profile(server_measured="yes")}, "mine.server_measured must be true or false"),
    ('{"mine": ' + json.dumps(_profile()).replace('"server_s": 0.0', '"server_s": NaN') + "}",
     "NaN is not a number JSON allows"),
    ({"mine": _profile(up_sent={"fixed": 1})}, "mine.up_sent must be an object of 'fixed'"),
    ({"a": _profile(), "b": _profile()}, "holds 2 profiles (['a', 'b'])"),
])
def test_a_bad_profile_file_is_named_before_round_1(tmp_path: Path, content: object,
                                                    message: str) -> None:
    path = str(tmp_path / "mine.json") if content is None else _write(tmp_path / "mine.json",
                                                                       content)
    with pytest.raises(SettingsError, match="netem.protocol") as err:
        NetemSettings(enabled=True, protocol=path)
    assert message in str(err.value) and "mine.json" in str(err.value)


def test_a_users_profile_file_and_the_keys_set_its_parts(tmp_path: Path) -> None:
    path = _write(tmp_path / "mine.json", {"_note": "my phones", "phone-fleet": _profile(
        poll_interval_s=10.0, clientapp_startup_s=0.5, server_s=1.25, server_measured=False)})
    settings = NetemSettings(enabled=True, protocol=path)
    model = settings.protocol_model()
    assert isinstance(model, ProtocolModel) and model.name == "phone-fleet"
    assert (model.poll_interval_s, model.clientapp_startup_s, model.server_s) == (10, 0.5, 1.25)
    assert settings.profile_file() == str(Path(path).resolve())
    assert "phone-fleet (from" in profile_line(settings)
    # Each part is a key of its own, laid over the profile; empty = the profile's.
    tuned = NetemSettings(protocol="supernode-tls", poll_interval_s="20", app_startup_s=0,
                          server_measured="false", server_s=2.0)
    m = tuned.protocol_model()
    assert (m.poll_interval_s, m.clientapp_startup_s, m.server_measured, m.server_s) == (
        20.0, 0.0, False, 2.0)
    assert "netem.poll_interval_s" in profile_line(tuned)
    assert NetemSettings.from_config(tuned.to_config()) == tuned
    assert NetemSettings.from_config(NetemSettings().to_config()) == NetemSettings()
    with pytest.raises(SettingsError, match="netem.app_startup_s = -1.0 is outside"):
        NetemSettings(app_startup_s=-1.0)
    with pytest.raises(SettingsError, match="netem.server_s set, but netem.protocol = 'none'"):
        NetemSettings(protocol="none", server_s=1.0)
    with pytest.raises(SettingsError, match="'bridge'.*'bridge-tls'"):
        NetemSettings(protocol="bridge")


def _run(tmp_path: Path, name: str, *sets: str) -> tuple[list[dict[str, str]], dict]:
    argv = ["run", "--set", "task=digits", "--set", "sim.engine=local", "--set", "rounds=2",
            "--set", "num_clients=8", "--set", "clients_per_round=3", "--set",
            "over_selection=1.5", "--set", "progress=false", "--set", f"results_dir={tmp_path}",
            "--set", f"run_name={name}", "--set", "netem.enabled=true", "--set",
            "netem.mix=3g:0.5,edge:0.5", "--set", "netem.intermittent=0.5", "--set",
            "netem.deadline_s=20"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    with (tmp_path / name / "rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    return rows, json.loads((tmp_path / name / "summary.json").read_text())


#: Columns that are the machine's (wall, CPU) or the measured server time and its sums.
_MEASURED = ("seconds", "seconds_max", "virtual_seconds", "round_server_s", "round_orchestration_s",
             "idle_uplink_bytes", "idle_downlink_bytes", "idle_joules")


def test_the_servers_measured_work_is_charged_off_the_links_clock(tmp_path: Path,
                                                                  capsys) -> None:
    """The default profile charges the server's work as this run measured it: every round's
    virtual time is its clients' part plus that; the links do not see it, so the run's drops,
    bytes and accuracy are those of the same run with the server's time left out."""
    measured, summary = _run(tmp_path, "measured")
    out = capsys.readouterr().out
    assert "protocol profile bridge-tls: a held call" in out
    alone, _ = _run(tmp_path, "alone", "netem.server_measured=false")
    for m, a in zip(measured, alone, strict=True):
        assert {k: v for k, v in m.items() if not k.endswith(_MEASURED)} == \
            {k: v for k, v in a.items() if not k.endswith(_MEASURED)}
        assert float(a["round_server_s"]) == 0 < float(m["round_server_s"])
        assert float(m["virtual_seconds"]) == pytest.approx(
            float(a["virtual_seconds"]) + float(m["round_server_s"]))
    assert summary["wire"]["protocol"] == "bridge-tls"
    assert summary["wire"]["profile"].startswith("bridge-tls: a held call")
    assert summary["server_seconds"] == pytest.approx(
        sum(float(r["round_server_s"]) for r in measured))
    # A fixed server time instead: each round exactly that, on the links' clock too.
    fixed, _ = _run(tmp_path, "fixed", "netem.server_measured=false", "netem.server_s=2.5")
    assert {float(r["round_server_s"]) for r in fixed} == {2.5}


def test_the_servers_evaluation_is_on_the_clock_only_when_asked(tmp_path: Path,
                                                                monkeypatch) -> None:
    """``netem.server_eval``: the central evaluation (here made to take 0.3 CPU seconds)
    delays the next round and is charged to it; off by default (a production server
    evaluates off the round's path)."""
    from tasks.task import Task

    evaluate = Task.evaluate

    def slow(self, *args, **kwargs):
        started = time.thread_time()
        while time.thread_time() - started < 0.3:
            pass
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Task, "evaluate", slow)
    on, _ = _run(tmp_path, "on", "netem.server_eval=true")
    off, _ = _run(tmp_path, "off")
    for a, b in zip(on, off, strict=True):
        assert float(a["round_server_s"]) - float(b["round_server_s"]) > 0.25
        assert a["accuracy"] == b["accuracy"]
