"""``python -m android_bridge export|serve|phone``: bad options get one line; a task of your own
(``module:callable``) goes to a phone.

The commands' runs end to end are in tests/test_deploy_phones.py (deploy starts ``serve`` and
``phone`` as processes) and docs/android.md's session.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from android_bridge.__main__ import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_usage_names_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("export", "serve", "phone"))


@pytest.mark.parametrize("devices,extra,message", [
    ("{", [], "is not JSON"),
    ('{"phone a": "' + "t" * 16 + '"}', [], r"device id 'phone a' must match"),
    ('{"phone-a": "short"}', [], "token of 'phone-a' must be a string of at least 16"),
    ("[]", [], "must hold a JSON object of device id -> token"),
    ('{"phone-a": "' + "t" * 16 + '"}', ["--insecure", "--listen", "0.0.0.0:8443"],
     "only on a loopback address; --listen 0.0.0.0:8443 is not one"),
    ('{"phone-a": "' + "t" * 16 + '"}', [], "phones connect over TLS: give --cert and --key"),
    ('{"phone-a": "' + "t" * 16 + '"}', ["--cert", "nope.pem", "--key", "nope.key"],
     "cannot read nope.key"),
    ('{"phone-a": "' + "t" * 16 + '"}', ["--insecure", "--timeout-s", "0"],
     "--timeout-s 0.0: expected seconds in"),
])
def test_serve_refuses_bad_options_in_one_line(devices, extra, message, tmp_path, capsys,
                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "devices.json").write_text(devices)
    assert main(["serve", "--devices", "devices.json", "--workdir", str(tmp_path / "w"),
                 *extra]) == 2
    err = _err(capsys)
    assert err.startswith("python -m android_bridge serve: error:") and message in err, err
    assert not (tmp_path / "w").exists()  # nothing made before the options are good


def test_phone_refuses_bad_options_in_one_line(tmp_path, capsys):
    base = ["phone", "--export", str(tmp_path), "--bridge", "127.0.0.1:1", "--device", "p",
            "--token", "t" * 16]
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 3), np.float32), y=np.zeros(2, np.int64))
    cases = [
        (["--data", str(tmp_path / "d.npz"), "--set", "task=digits"],
         "--data and --set/--run-config both pick the data"),
        (["--set", "task=digits"], "give --partition-id"),
        (["--set", "task=digits", "--set", "num_clients=2", "--set", "clients_per_round=2",
          "--partition-id", "2"], "--partition-id 2: expected 0..1"),
        (["--set", "task=nosuch", "--partition-id", "0"], "task"),
        (["--data", str(tmp_path / "none.npz")], "expected an .npz with x and y"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = _err(capsys)
        assert err.startswith("python -m android_bridge phone: error:") and message in err, err


def test_phone_data_is_what_client_app_trains_on():
    """The phone's data for a key is client.app's for that key (any task: its data function)."""
    from android_bridge.run_phone import parser, phone_data
    from client.app import client_data
    from fedgc.settings import RunConfig

    keys = {"task": "digits", "num_clients": 5, "clients_per_round": 5, "seed": 3}
    args = parser().parse_args(["--export", "e", "--bridge", "b:1", "--device", "d",
                                "--token", "t", "--partition-id", "4",
                                *[a for k, v in keys.items() for a in ("--set", f"{k}={v}")]])
    x, y = phone_data(args)
    want_x, want_y = client_data(RunConfig.from_flat(keys).train, 4, None)
    assert np.array_equal(x, want_x.numpy()) and np.array_equal(y, want_y.numpy())


def test_export_refusals_name_the_task(tmp_path, capsys):
    assert main(["export", "--out", str(tmp_path / "o"), "--model", "nosuch.mod:build"]) == 2
    assert "export failed: task = 'nosuch.mod:build': no module named 'nosuch'" in _err(capsys)
    assert main(["export", "--out", str(tmp_path / "o"), "--model", "mlp-digits",
                 "--set", "lr=0.2"]) == 2
    assert "--model mlp-digits is a registered model, not a task" in _err(capsys)
    assert main(["export", "--out", str(tmp_path / "o"), "--set", "method=stc"]) == 2
    assert "method 'stc' is not served by phones" in _err(capsys)
    # issue 30's dgc switches phones do not run: a run that sets one gets no phone files
    # (dgc_sets' switches, dgc.shared_first here, phones run since issue 39: not named).
    assert main(["export", "--out", str(tmp_path / "o"), "--set", "dgc.step_ahead=0.5",
                 "--set", "dgc.residual_decay=0.5", "--set", "dgc.shared_first=true"]) == 2
    assert ("dgc.residual_decay=0.5, dgc.step_ahead=0.5: phones run dgc's default client"
            in _err(capsys))
    assert not (tmp_path / "o").exists()


def test_every_method_of_the_registry_exports_or_is_refused_with_its_reason(tmp_path, capsys):
    """Issue 39: each registered method either runs on phones (its phone export gives the
    encoder's config) or ``export`` refuses it in one line naming what it needs that phones
    lack and the methods they run; the bridge refuses it with the same line."""
    from android_bridge.bridge import BridgeError
    from android_bridge.bridge_app import _phone_config
    from android_bridge.export import check_phone_run, phone_config
    from fedgc import methods
    from fedgc.settings import RunConfig

    served = methods.phone_methods()
    assert {"dgc", "topk", "randk", "efsign", "signvote", "qsgd", "tcs"} <= set(served)
    refused = []
    for m in methods.registered():
        run = RunConfig.from_flat({"method": m.name})
        if m.name in served:
            assert check_phone_run(run.method, run.server) is not None
            task = _phone_config(run.train, run.method, client_key=2)
            assert task["train"]["method"] == m.name
            # the exported encoder, or one of the method's own whose payload the bridge reads
            kind = task.get("codec", {}).get("payload")
            assert kind is None or methods.phone_codec_of(kind).kind == kind
            assert phone_config(run).density == m.uplink_density(run.train)
            continue
        refused.append(m.name)
        out = tmp_path / m.name
        assert main(["export", "--out", str(out), "--set", f"method={m.name}"]) == 2
        line = _err(capsys)
        assert not out.exists()  # _err: one line
        assert line.strip() == f"export failed: {methods.phone_refusal(run.method)}"
        # its own reason (not the undeclared default) and the methods phones run
        assert m.phone_needs and f"it needs {m.phone_needs}; phones run {served}" in line
        with pytest.raises(BridgeError, match=r"is not served by phones: it needs "):
            _phone_config(run.train, run.method)
    assert {"dense", "powersgd", "fetchsgd"} <= set(refused) and "dgc_sets" not in refused
    assert len(set(m.phone_needs for m in methods.registered() if m.name in refused)) == \
        len(refused) - 1  # fedavgm is dense with server momentum: dense's reason


@pytest.mark.slow
def test_a_task_of_your_own_trains_on_the_phone_as_in_simulation(monkeypatch):
    """``task = "own_task.task:build"`` (examples/own_task: a 1-D CNN): its exported training
    step (ExecuTorch, dynamic batch) follows fedgc.training.train_locally within 1e-5."""
    from android_bridge.export import TRAIN_FILE, export_training_step
    from android_bridge.models import get_model
    from android_bridge.runtime import PteTrainer
    from android_bridge.shuffle import local_batches
    from fedgc.settings import TaskSpec
    from fedgc.task_loader import load_task
    from fedgc.training import train_locally

    monkeypatch.syspath_prepend(str(EXAMPLES))
    options = json.dumps({"num_train": 23, "num_test": 5})
    spec = get_model("own_task.task:build", options)
    assert (spec.input_shape, spec.num_classes) == ((1, 32), 4)
    task = load_task(TaskSpec("own_task.task:build", "", "", "", options))
    torch.manual_seed(0)
    model = spec.build()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / TRAIN_FILE).write_bytes(export_training_step(spec, spec.build(), 10))
        (Path(tmp) / "manifest.json").write_text(json.dumps({"training": {
            "input_shape": [10, *spec.input_shape], "learning_rate": 0.1,
            "dynamic_batch": True}}))
        trainer = PteTrainer(tmp)
        trainer.set_parameters({k: v.numpy() for k, v in start.items()})
        trainer.set_learning_rate(0.1, momentum=0.5)
        x, y = task.train_x.numpy(), task.train_y.numpy()
        losses = trainer.train((x[b], y[b]) for b in local_batches(23, 10, 1, 0, 7))
        local = trainer.parameters()
    eager = train_locally(model, task.train_x, task.train_y, task.training_loss, lr=0.1,
                          batch_size=10, local_epochs=1, local_steps=0, momentum=0.5, seed=7)
    assert len(losses) == eager.steps == 3
    for name, g in eager.pseudo_gradient.items():
        assert np.abs((start[name].numpy() - local[name]) - g.numpy()).max() < 1e-5, name


def test_the_runtimes_cpu_probe_lines_are_silenced_where_the_pool_starts() -> None:
    """ExecuTorch's thread pool logs ``[cpuinfo_utils.cpp:...]`` lines as it starts, on any
    machine (five on this x86 host, every phone process printed them): PteEncoder and
    PteTrainer start it through ``android_bridge.notices.start_threadpool``, which keeps them
    off the process's stderr and nothing else."""
    import subprocess
    import sys

    from android_bridge.notices import CPU_PROBE

    done = subprocess.run([sys.executable, "-c", (
        "import os\n"
        "from android_bridge import notices\n"
        "from android_bridge.runtime import PteEncoder, PteTrainer\n"
        "from dgc.config import DGCConfig\n"
        "for make in (lambda: PteEncoder('/nonexistent.pte', DGCConfig(selection='exact'), {}),\n"
        "             lambda: PteTrainer('/nonexistent')):\n"
        "    notices._threadpool_started = False\n"
        "    try:\n"
        "        make()\n"
        "    except Exception:\n"
        "        pass\n"
        "    print(notices._threadpool_started)\n"
        "os.write(2, b'stderr still written\\n')\n")],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
        check=True)
    assert done.stdout.split() == ["True", "True"]
    assert CPU_PROBE not in done.stderr and "stderr still written" in done.stderr
