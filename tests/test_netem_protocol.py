"""The emulator's protocol model against deployments it was not calibrated on.

``simulations/netem/protocols.json`` was fitted on captured mnist5k deployments (the MLP of
159k parameters). The fixtures here are the wire ledgers of captured *digits* deployments
(2 SuperNodes, 3 rounds, TLS, `tbf` links; dense and dgc on LTE and 3G), made with

    python -m simulations deploy --nodes 2 --link LINK --tls --capture --set task=digits \\
        --set rounds=3 --set method=METHOD
    python tests/fixtures/wire/make_fixture.py RUN_DIR > tests/fixtures/wire/NAME.json

The same scenario under the emulator (``netem.protocol=supernode-tls``, same seeds, so the same
payloads) must put on each client's link, per client-round and each way, within 10% of the
bytes the deployment's links carried, and its rounds' orchestration (the wait for a poll, the
ClientApp's start-up, the server's own time) within 25% of the deployment's (rounds after the
first, whose start-up the emulator does not model).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from simulations.cli import main
from simulations.netem.protocol import load_protocols, message_objects

FIXTURES = Path(__file__).parent / "fixtures" / "wire"
# One case in the fast suite; the others (an emulated run each) with the slow tests.
CASES = [("dgc", "lte"), pytest.param("dense", "lte", marks=pytest.mark.slow),
         pytest.param("dgc", "3g", marks=pytest.mark.slow),
         pytest.param("dense", "3g", marks=pytest.mark.slow)]


def _fixture(method: str, link: str) -> dict:
    return json.loads((FIXTURES / f"digits-{method}-{link}-tls.json").read_text())


@pytest.mark.parametrize(("method", "link"), CASES)
def test_the_emulator_puts_on_the_link_what_a_deployment_did(tmp_path: Path, method: str,
                                                              link: str) -> None:
    deployed = _fixture(method, link)
    argv = ["run", "--set", "task=digits", "--set", "num_clients=2", "--set",
            "clients_per_round=2", "--set", "rounds=3", "--set", f"method={method}",
            "--set", "sim.engine=local", "--set", "progress=false", "--set",
            f"results_dir={tmp_path}", "--set", "run_name=emu", "--set", "netem.enabled=true",
            "--set", f"netem.mix={link}:1.0", "--set", "netem.protocol=supernode-tls"]
    assert main(argv) == 0
    wire = json.loads((tmp_path / "emu" / "summary.json").read_text())["wire"]
    assert wire["client_rounds"] == deployed["client_rounds"] == 6
    for d in ("up", "down"):
        captured = deployed["per_client_round"][d]
        # Same seeds, same payloads: what differs is the protocol, modelled.
        assert wire[f"payload_{d}_bytes_per_client_round"] == pytest.approx(captured["payload"])
        on_link = sum(captured.values())
        emulated = wire[f"link_{d}_bytes_per_client_round"]
        assert abs(emulated / on_link - 1) <= 0.10, (d, emulated, on_link)
    later = [r for r in deployed["rounds"] if r["round"] > 1]
    orchestration = statistics.fmean(r["orchestration_s"] for r in later)
    emulated = wire["round_split_s"]["orchestration"]
    assert abs(emulated / orchestration - 1) <= 0.25, (emulated, orchestration)


def test_protocol_models_cost_what_their_parts_say() -> None:
    """The shipped model: an object costs more than a byte of content, polls and heartbeats
    make an idle node's traffic, and the counts of Flower's objects follow its chunking."""
    models = load_protocols()
    tls = models["supernode-tls"]
    up_small, down_small = tls.download(1_000, 6)
    up_more, down_more = tls.download(1_000, 7)
    assert down_more - down_small == round(tls.down_sent.per_object) or abs(
        (down_more - down_small) - tls.down_sent.per_object) <= 1
    assert tls.rpcs("down", 6) == tls.rpcs_down_fixed + 6
    assert models["bridge-tls"].rpcs("up", 3) == models["bridge-tls"].rpcs_up_fixed
    up, down = tls.idle_bytes(60.0)
    assert up == pytest.approx(60 / tls.poll_interval_s * tls.poll_bytes_up
                               + 60 / tls.heartbeat_interval_s * tls.heartbeat_bytes_up)
    assert message_objects([100, 6 * 1024 * 1024], records=3) == 2 + 3 + 2 + 3
