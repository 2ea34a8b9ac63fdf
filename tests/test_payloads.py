"""Every payload kind a registered method declares: its golden vectors, and its decoder's bound.

A method's codec (``fedgc.methods.Codec``) must reproduce ``tests/golden/payloads/<kind>.json``
byte for byte and decode it to the recorded content, and its decoder must refuse a damaged or
truncated message with a DecodeError (never another exception, never an allocation beyond the
bound), whatever the kind: a new method's payload is held to this by being registered.
"""

from __future__ import annotations

import json
import random

import pytest

from dgc import DecodeError
from fedgc import methods
from tests.golden.payload_golden import GOLDEN_DIR, codec_of, codecs, content, records

KINDS = codecs()


def test_every_registered_methods_payload_kind_has_golden_vectors():
    kinds = {codec_of(m).kind for m in methods.registered()}
    assert kinds == set(KINDS) and "sparse" in kinds
    for kind in kinds:
        assert (GOLDEN_DIR / f"{kind}.json").exists(), \
            f"no golden vectors for {kind!r}: PYTHONPATH=. python tests/golden/payload_golden.py"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_codec_reproduces_its_golden_vectors(kind):
    golden = json.loads((GOLDEN_DIR / f"{kind}.json").read_text())
    assert golden == records(kind, KINDS[kind]), f"{kind}: the encoder's bytes changed"
    for m in methods.registered():
        codec = codec_of(m)
        if codec.kind != kind:
            continue
        for case in golden["cases"]:
            decoded = codec.decode(bytes.fromhex(case["hex"]), codec.golden_bound(case["case"]))
            assert decoded.sequence == case["sequence"]
            assert content(decoded) == case["parts"], f"{m.name} decodes {case['case']} apart"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_message_is_a_decode_error(kind):
    """Every prefix and a sample of single-bit flips of every golden message: a DecodeError
    or (a flip the CRC cannot see, there is none in a 32-bit CRC over these sizes) the same
    content; nothing else escapes."""
    codec = KINDS[kind]
    rng = random.Random(0)
    golden = json.loads((GOLDEN_DIR / f"{kind}.json").read_text())
    for case in golden["cases"]:
        data = bytes.fromhex(case["hex"])
        bound = codec.golden_bound(case["case"])
        for cut in range(len(data)):
            with pytest.raises(DecodeError):
                codec.decode(data[:cut], bound)
        for bit in rng.sample(range(8 * len(data)), min(64, 8 * len(data))):
            flipped = bytearray(data)
            flipped[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(DecodeError):
                codec.decode(bytes(flipped), bound)
        with pytest.raises(DecodeError):
            codec.decode(data + b"\0", bound)
