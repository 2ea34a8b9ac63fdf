"""The README's quick commands run as written (the block after ``<!-- quick: ... -->``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The marker a README block carries when this test runs it: an HTML comment, unseen on GitHub.
MARKER = "<!-- quick:"


def api_block(markdown: str) -> str:
    """The Python block right after the ``<!-- api: ... -->`` line."""
    found = re.findall(r"^<!-- api:.*?-->\n```python\n(.*?)^```", markdown, re.M | re.S)
    assert len(found) == 1, "the README's <!-- api: --> block is missing or not alone"
    return found[0]


def quick_commands(markdown: str) -> list[str]:
    """The commands of every fenced block right after a ``<!-- quick: ... -->`` line: one per
    logical line (backslash continuations joined), comment-only and blank lines left out."""
    commands: list[str] = []
    for block in re.findall(r"^<!-- quick:.*?-->\n```[a-z]*\n(.*?)^```", markdown, re.M | re.S):
        text = re.sub(r"\s*\\\n\s*", " ", block)
        commands += [line.strip() for line in text.splitlines()
                     if line.strip() and not line.strip().startswith("#")]
    return commands


def test_quick_commands_are_extracted_whole() -> None:
    md = ("text\n<!-- quick: x -->\n```sh\npython -m a --set b=1 \\\n    --set c=2  # note\n"
          "# only a comment\n\npython -m d\n```\n```sh\nnot quick\n```\n")
    assert quick_commands(md) == ["python -m a --set b=1 --set c=2  # note", "python -m d"]


@pytest.mark.slow
def test_readme_quick_commands_run(tmp_path: Path) -> None:
    """Each command in a fresh folder, with this checkout's packages and the running venv's
    ``python`` first on PATH; exit status 0, no traceback, and the files the README names."""
    readme = (ROOT / "README.md").read_text()
    commands = quick_commands(readme)
    assert len(commands) >= 4, f"the README's {MARKER} block is missing or lost commands"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    printed = {}
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=600, check=False)
        assert done.returncode == 0 and "Traceback" not in done.stderr, \
            f"README command failed ({done.returncode}): {command}\n{done.stderr[-3000:]}"
        printed[command.split()[3]] = done.stdout
    # The figures the text after the block states are those the run prints.
    from fedgc.settings import ROBUST_PROFILES
    from server.defences import describe

    fedavg, _, _ = _stated_defences(readme)
    off = ROBUST_PROFILES["off"]
    assert fedavg == "FedAvg" and describe(off["max_weight_ratio"], off["max_norm_ratio"],
                                           off["aggregation"], 0.1) in printed["run"], \
        printed["run"][:2000]
    # What the text after the block promises.
    runs = list((tmp_path / "results").glob("*-digits-dgc"))
    assert len(runs) == 1 and (runs[0] / "plots.png").exists()
    assert list((runs[0] / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "results" / "quick" / "virtual.png").exists()


def _stated_defences(readme: str) -> tuple[str, str, str]:
    """What the quick start says a simulation and a deployment aggregate with by default."""
    found = re.search(r"a simulation aggregates with plain (\w+) \(`robust = auto` is off "
                      r"there\), a deployment with (centered clipping|\w+) and weights capped "
                      r"at the round's (\w+)", re.sub(r"\s+", " ", readme))
    assert found, "the quick start no longer states the default defences"
    named = {"centered clipping": "centered_clip"}
    return found.group(1), named.get(found.group(2), found.group(2)), found.group(3)


def test_the_stated_defences_are_the_defaults() -> None:
    from fedgc.settings import ROBUST_PROFILES, ServerSettings

    fedavg, deployed, cap = _stated_defences((ROOT / "README.md").read_text())
    assert ServerSettings().robust == "auto"
    assert fedavg == "FedAvg"
    assert ROBUST_PROFILES["off"] == {"aggregation": "mean", "max_weight_ratio": 0.0,
                                      "max_norm_ratio": 0.0, "min_cosine": -1.0,
                                      "gate_memory": 0.0, "gate_memory_below": 0.0,
                                      "gate_first_bar": -1.0, "clip_radius_clean": 0.0}
    assert cap == "median" and ROBUST_PROFILES["on"]["max_weight_ratio"] == 1.0
    assert ROBUST_PROFILES["on"]["aggregation"] == deployed
    gate = "leaving out updates that point against the aggregates' moving average"
    assert (gate in re.sub(r"\s+", " ", (ROOT / "README.md").read_text())) == (
        ROBUST_PROFILES["on"]["min_cosine"] == 0.0)
    memory = "a client whose left-out update pointed clearly against it"
    assert (memory in re.sub(r"\s+", " ", (ROOT / "README.md").read_text())) == (
        ROBUST_PROFILES["on"]["gate_memory"] > 0)


@pytest.mark.slow
def test_readme_api_block_runs_as_written(tmp_path: Path) -> None:
    """The README's Python block, as written, in a fresh folder: it prints what it says."""
    block = api_block((ROOT / "README.md").read_text())
    assert "import fedgc" in block and "fedgc.run(" in block and "fedgc.compare(" in block
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, text=True,
                          capture_output=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    # Among the run's and the comparison's own lines, the block's two prints.
    one = re.search(r"^(\S+) (\d+) (results/\S+-digits-dgc)$", done.stdout, re.M)
    assert one, done.stdout[-3000:]
    assert 0 < float(one.group(1)) <= 1 and int(one.group(2)) > 0
    assert (tmp_path / one.group(3) / "summary.json").is_file()
    both = re.search(r"^(\S+) \{'dense': \[RunResult\(folder=.*'dgc': \[RunResult\(", done.stdout,
                     re.M)
    assert both and float(both.group(1)) > 1, done.stdout[-3000:]  # DGC sends less than dense
    assert re.search(r"RunResult\(folder=PosixPath\('results/\d{8}-\d{6}-digits-compare/dgc'\)",
                     done.stdout)  # a comparison's folder, named as the command line names it


def test_the_readme_makes_the_venv_with_make_install() -> None:
    """The first run's venv comes from ``make install``, the target that only installs."""
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    found = re.search(r"source \.venv/bin/activate` after `make (\S+)`\)", readme)
    assert found and found.group(1) == "install", found
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^install: \$\(STAMP\)\n\t@echo", makefile, re.M)
