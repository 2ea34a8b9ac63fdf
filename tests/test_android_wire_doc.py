"""WIRE_FORMAT.md carries docs/wire.md verbatim, so the phone-side spec cannot drift."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wire_format_doc_contains_the_wire_spec_verbatim():
    spec = (ROOT / "docs" / "wire.md").read_text().split("\n", 1)[1]  # without its title line
    phone_doc = (ROOT / "android_bridge" / "WIRE_FORMAT.md").read_text()
    assert spec.strip() in phone_doc, "WIRE_FORMAT.md drifted from docs/wire.md: rebuild it"
    assert "## 0. Where the bridge carries these bytes" in phone_doc
