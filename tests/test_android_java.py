"""The Java wire codec (what the Android app links), compiled with javac and run here.

It feeds the codec updates made by the exported ExecuTorch encoder (through ``dgc.encode``) and
checks that Java decodes and re-encodes them byte for byte (the codec's golden-vector driver runs
in ``tests/test_java_codec.py``). Skipped, with the reason, where javac or java is missing. In the
arm lane of ``make test``: the encoder is the session's export (``encoder_pte``), the codec the
session's compile (``java_classpath``).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

import dgc
from android_bridge.runtime import PteEncoder
from tests.test_android_export import CONFIGS

#: An exported encoder's config with density 0.01 (a few dozen entries a tensor below).
ENCODER = "nesterov-dampened-clipped"


def test_java_reencodes_updates_of_the_exported_encoder_byte_for_byte(java_classpath, encoder_pte,
                                                                     tmp_path):
    path = tmp_path / "encoder.pte"
    path.write_bytes(encoder_pte(ENCODER))
    shapes = {"w": (60, 50), "b": (50,), "v": (40, 40)}
    pte = PteEncoder(path, CONFIGS[ENCODER], shapes)
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
    done = subprocess.run(["java", "-cp", str(java_classpath), "org.fedgc.wire.WireTool"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[:-1] == expected
    assert out[-1].startswith("REJECT")
    with pytest.raises(dgc.DecodeError):
        dgc.decode(bytes(corrupt), max_numel=dgc.wire.MAX_NUMEL)
