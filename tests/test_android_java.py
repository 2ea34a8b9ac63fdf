"""The Java wire codec (what the Android app links), compiled with javac and run here.

It runs the codec's own test driver against tests/golden/wire_v1.json, then feeds it updates made
by the exported ExecuTorch encoder (through ``dgc.encode``) and checks that Java decodes and
re-encodes them byte for byte. Skipped, with the reason, where javac or java is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import dgc
from android_bridge.export import export_encoder
from android_bridge.runtime import PteEncoder
from dgc import DGCConfig

ROOT = Path(__file__).resolve().parents[1]
JAVA = ROOT / "android_bridge" / "java" / "src"
GOLDEN = ROOT / "tests" / "golden" / "wire_v1.json"

pytestmark = pytest.mark.skipif(shutil.which("javac") is None or shutil.which("java") is None,
                                reason="javac/java not on PATH (install a JDK 17)")


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("classes")
    sources = sorted(str(p) for p in JAVA.rglob("*.java"))
    assert sources, f"no Java sources under {JAVA}"
    done = subprocess.run(["javac", "--release", "17", "-Xlint:all", "-Werror", "-d", str(out),
                           *sources], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_java_codec_passes_its_golden_vector_driver(classes):
    done = subprocess.run(["java", "-cp", str(classes), "org.fedgc.wire.WireCodecTest",
                           str(GOLDEN)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_java_reencodes_updates_of_the_exported_encoder_byte_for_byte(classes, tmp_path):
    config = DGCConfig(selection="exact", value_dtype="float16", density=0.01)
    path = tmp_path / "encoder.pte"
    path.write_bytes(export_encoder(config, max_numel=8192))
    shapes = {"w": (60, 50), "b": (50,), "v": (40, 40)}
    pte = PteEncoder(path, config, shapes)
    gen = torch.Generator().manual_seed(7)
    lines, expected = [], []
    for step in range(4):
        grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        data = dgc.encode(pte.compress(grads, epoch=float(step)))
        lines.append(f"codec auto {data.hex()}")
        expected.append(f"OK {data.hex()}")
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF  # the CRC no longer matches
    lines.append(f"codec auto {bytes(corrupt).hex()}")
    done = subprocess.run(["java", "-cp", str(classes), "org.fedgc.wire.WireTool"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[:-1] == expected
    assert out[-1].startswith("REJECT")
    with pytest.raises(dgc.DecodeError):
        dgc.decode(bytes(corrupt), max_numel=dgc.wire.MAX_NUMEL)
