"""docs/android.md's phone session runs as written: the export, the bridge with its SuperNode, a
reference phone, a plain SuperNode and ``flwr run`` of the checkout, on a real SuperLink.

The block after the ``<!-- session: ... -->`` comment runs in bash from the checkout, with
``HOME`` a fresh folder (the session works in ``~/fedgc-phones``) and the three ports it names
replaced by free ones (the document: any free ones do), as tests/test_readme.py runs the
README's quick block.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The ports the session names: the SuperLink's, the bridge's, the plain SuperNode's.
PORTS = ("9092", "8443", "9095")


def session_block(markdown: str) -> str:
    """The shell block right after the ``<!-- session: ... -->`` line."""
    found = re.findall(r"^<!-- session:.*?-->\n```sh\n(.*?)^```", markdown, re.M | re.S)
    assert len(found) == 1, "docs/android.md's <!-- session: --> block is missing or not alone"
    return found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _untracked() -> set[str]:
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return set(done.stdout.splitlines()) if done.returncode == 0 else set()


def test_the_session_keeps_flower_and_the_tokens_out_of_the_checkout() -> None:
    """Before anything runs: a folder of its own, Flower's home there, no dependency
    installation by the SuperLink, one file of run keys for the export, the phone and the run
    (the export and phone of the session once stopped on clients_per_round = 10 > 2)."""
    block = session_block((ROOT / "docs" / "android.md").read_text())
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("FEDGC=$PWD && mkdir -p ~/fedgc-phones && cd ~/fedgc-phones")
    assert lines[1] == ("export FLWR_HOME=$PWD/flwr-home "
                        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1")
    assert all("--set" not in line for line in lines)
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    for command in ("python -m android_bridge export", "python -m android_bridge phone",
                    "flwr run"):
        line = next(x for x in joined.splitlines() if x.startswith(command))
        assert "--run-config run.toml" in line, line


@pytest.mark.slow
def test_the_phone_session_runs_as_written(tmp_path: Path) -> None:
    script = session_block((ROOT / "docs" / "android.md").read_text())
    for port in PORTS:
        assert port in script
        script = script.replace(port, str(_free_port()))
    before = _untracked()
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # The test's own guard: whatever happens, the session's background processes end with it.
    guarded = f'trap \'kill $(jobs -p) 2>/dev/null\' EXIT\n{script}'
    proc = subprocess.Popen(["bash", "-e", "-c", guarded], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the session left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-5000:]
    session = tmp_path / "fedgc-phones"
    assert "[phone-a] round 2:" in out and "DELIVERED" in out, out[-5000:]
    assert re.search(r"^round\s+2/2 .* clients 2/2 failed 0", out, re.M), out[-5000:]
    assert "cpuinfo_utils" not in out  # the phone's runtime starts quietly
    summaries = list((session / "results").glob("*/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["rounds"] == 2 and summary["num_clients"] == 2
    assert (session / "flwr-home" / "config.toml").exists()
    assert _untracked() == before  # nothing written into the checkout
