"""Fuzz of the server's reply path, every method of the registry: no reply stalls a round.

One round of a digits run per method (4 clients, all aggregated; the real ClientApp trains and
compresses on fedgc's in-process grid), then many rounds built from it, each with one or two of
the honest replies replaced by a mutant of its bytes (and the shared signs, where a method sends
them): bits flipped, the bytes cut, a value
overwritten by a huge float (3e38, 1.7e38, 1e20, the float16 limit, NaN, Inf, in float32,
float16 and bfloat16), a float field of the reply (a scale, a norm, a value) scaled to the
float32 limit, random bytes written; the CRC trailer made right again for most of them, so that
they reach the codec's checks and the server's. Each round goes through the server's check and
combine (``DGCStrategy.check_replies`` and ``aggregate_checked``: the reply check, the
defences, the combine, the method's aggregator, the server optimizer) from the same state.

A stall is a round whose honest replies are not all aggregated, or that applies no aggregate
(before issue 35 a QSGD norm of 3e38 made the aggregate Inf and failed every such round). The
script prints, per method, the mutants tried, how many the server refused (by reason) or
accepted, the stalls (there must be none: exit 1 otherwise) and the seconds taken::

    python bench/reply_fuzz.py                       # 10,000 mutants per method (minutes)
    python bench/reply_fuzz.py --mutants 200 --methods qsgd,powersgd --robust on

``tests/test_reply_fuzz.py`` runs a smaller fuzz of every method in the fast suite.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import re
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402

from client.app import app as client_app  # noqa: E402
from dgc import DecodeError  # noqa: E402
from fedgc import methods  # noqa: E402
from fedgc import protocol as P  # noqa: E402
from fedgc.schema import fields_of  # noqa: E402
from fedgc.settings import RunConfig  # noqa: E402
from server.local_grid import LocalGrid  # noqa: E402
from server.strategy import DGCStrategy  # noqa: E402
from tasks import get_task  # noqa: E402

#: Clients of the fuzzed round, every one aggregated.
CLIENTS = 4
#: What a huge-value mutant writes: float32 values.
HUGE = (3e38, -3e38, 1.7e38, 1e20, -1e20, 2.0 ** 64 * 1.5, 65504.0, float("nan"),
        float("inf"), float("-inf"))
#: The same as float16 bit patterns: its largest finite, Inf, NaN, -Inf.
HUGE_HALF = (0x7BFF, 0x7C00, 0x7E00, 0xFC00)
#: The same as bfloat16 bit patterns: its largest finite, Inf, NaN, 1e20-ish.
HUGE_BF16 = (0x7F7F, 0x7F80, 0x7FC0, 0x60AD)
KINDS = ("flip", "truncate", "huge", "scale", "scale2", "random")


@dataclass
class Outcome:
    """What the fuzz of one method found."""

    method: str
    mutants: int = 0
    stalls: int = 0
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    first_stall: str = ""

    def line(self) -> str:
        top = ", ".join(f"{r} {n}" for r, n in self.refused.most_common(4))
        return (f"{self.method:<17} {self.mutants:>6} mutants  {self.stalls} stalls  "
                f"{self.accepted:>5} accepted  {sum(self.refused.values()):>6} refused "
                f"({top})  {self.seconds:6.1f} s")


def _reseal(data: bytearray, inner: int = -1) -> bytes:
    """``data`` with its CRC-32 trailer made right again (``dgc.wire.framing``'s trailer: the
    CRC of every byte before it, little-endian), and first that of the frame nested at offset
    ``inner`` (-1: none) up to the trailer, as TCS nests an ``FGCU`` in its ``FGCV``."""
    end = len(data) - 4
    if 0 < inner <= end - 8:
        data[end - 4:end] = struct.pack("<I", zlib.crc32(bytes(data[inner:end - 4])))
    if len(data) >= 4:
        data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return bytes(data)


def _inner_frame(data: bytes) -> int:
    """The offset of the last frame nested in ``data`` (a magic ``FGC`` + a capital letter
    after the preamble), -1 for none."""
    at = -1
    for found in re.finditer(rb"FGC[A-Z]", data[4:]):
        at = found.start() + 4
    return at


#: The most candidate offsets :func:`live_fields` tries (a decode each): a dense reply holds
#: thousands of plausible floats, all values alike; a sign payload's few scales hide among a
#: few hundred windows of sign bits.
MAX_TRIED_FIELDS = 600


def live_fields(data: bytes, peak: Callable[[bytes], float]) -> list[int]:
    """Offsets of the float32 fields of a reply's bytes that reach its values (a scale, a
    norm, a value): 4 bytes that read as a finite float of magnitude 1e-10 .. 1e6 and, set to
    3e38 (the CRC made right again), decode to a payload whose values reach 1e30 or more
    (``peak``: the decoded payload's ``max_abs``, -1 when the bytes do not decode). At most
    :data:`MAX_TRIED_FIELDS` candidates are tried, a seeded sample of them beyond."""
    if len(data) < 8:
        return []
    body = np.frombuffer(data[:-4], dtype=np.uint8)
    values = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(body, 4)) \
        .view("<f4").reshape(-1)
    with np.errstate(invalid="ignore"):
        plausible = np.isfinite(values) & (np.abs(values) > 1e-10) & (np.abs(values) < 1e6)
    inner = _inner_frame(data)
    candidates = np.flatnonzero(plausible)
    if candidates.size > MAX_TRIED_FIELDS:
        candidates = np.sort(np.random.default_rng(35).choice(candidates, MAX_TRIED_FIELDS,
                                                              replace=False))
    live = []
    for at in candidates.tolist():
        out = bytearray(data)
        struct.pack_into("<f", out, at, 3e38)
        if peak(_reseal(out, inner)) >= 1e30:
            live.append(at)
    return live


def mutate(data: bytes, rng: np.random.Generator, fields: Sequence[int] = (),
           ) -> tuple[str, bytes]:
    """(kind, a mutant of a reply's payload bytes) (module docstring); ``fields``: its float32
    fields (:func:`live_fields`), which a "scale" mutant sets to the float32 limit."""
    kind = KINDS[int(rng.integers(len(KINDS)))]
    out = bytearray(data)
    if not out:
        return kind, bytes(rng.integers(0, 256, 16, dtype=np.uint8))
    if kind == "truncate":
        out = out[:int(rng.integers(len(out)))]
    elif kind == "flip":
        for _ in range(int(rng.integers(1, 9))):
            bit = int(rng.integers(8 * len(out)))
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == "huge":
        width = (4, 2, 2)[int(rng.integers(3))]
        at = int(rng.integers(max(len(out) - 4 - width, 1)))
        if width == 4:
            out[at:at + 4] = struct.pack("<f", HUGE[int(rng.integers(len(HUGE)))])
        else:
            table = HUGE_HALF if rng.random() < 0.5 else HUGE_BF16
            out[at:at + 2] = struct.pack("<H", table[int(rng.integers(len(table)))])
    elif kind in ("scale", "scale2") and fields:
        # One field to the float32 limit (or 2**100 times its value), or two to 1e20 or 3e38
        # (PowerSGD's product of factors of 1e20 overflows; either alone does not).
        picked = rng.choice(len(fields), min(len(fields), 1 if kind == "scale" else 2),
                            replace=False)
        big = 3.4e38 if kind == "scale" else (1e20, 3e38)[int(rng.integers(2))]
        for at in (fields[int(j)] for j in picked):
            (value,) = struct.unpack_from("<f", out, at)
            scaled = math.copysign(big, value) if kind == "scale2" or rng.random() < 0.7 \
                else value * 2.0 ** 100
            struct.pack_into("<f", out, at, float(np.float32(scaled)))
    else:
        at = int(rng.integers(len(out)))
        n = int(rng.integers(1, 17))
        out[at:at + n] = bytes(rng.integers(0, 256, n, dtype=np.uint8))
    return kind, _reseal(out, _inner_frame(data)) if rng.random() < 0.85 else bytes(out)


#: The round fuzzed: the second, so that the replies answer round material (DGC's shared
#: signs, TCS's mask, PowerSGD's warm-started Q) and clients hold state.
ROUND = 2


def cases(names: Sequence[str] = ()) -> dict[str, dict[str, object]]:
    """Label -> run keys of each case fuzzed: every registered method (or ``names``) with its
    defaults, and, for a method whose own keys say how its values travel (a ``*.value_dtype``
    key: ``dgc.value_dtype`` for the sparsifiers, ``powersgd.value_dtype``), float32 too
    (float16's largest is 65504; PowerSGD's factors of 1e20 need float32 or bfloat16)."""
    out: dict[str, dict[str, object]] = {}
    for m in methods.registered():
        if names and m.name not in names:
            continue
        out[m.name] = {"method": m.name}
        own = {f.metadata["key"] for f in fields_of(m.settings)} if m.settings else set()
        for key in sorted(k for k in own if k.endswith(".value_dtype")):
            out[f"{m.name}+float32"] = {"method": m.name, key: "float32"}
    return out


def honest_round(keys: Mapping[str, object], robust: str, workdir: Path, seed: int = 0,
                 ) -> tuple[DGCStrategy, list[tuple[Message, Message]]]:
    """A strategy of a digits run of ``keys`` after :data:`ROUND`'s ``configure_train``, and
    each train message of that round with its honest reply, trained and compressed by the real
    ClientApp (the rounds before run whole)."""
    config = RunConfig.from_flat({
        "task": "digits", "num_clients": CLIENTS, "clients_per_round": CLIENTS, "seed": seed,
        "robust": robust, "checkpoint": False, "progress": False, "sim.engine": "local",
        "results_dir": str(workdir), "run_name": "fuzz", "state_dir": str(workdir / "state"),
        "local_steps": 2, **keys})
    strategy = DGCStrategy(config)
    grid = LocalGrid(client_app, CLIENTS, seed=seed)
    strategy.registry.bind(CLIENTS)
    strategy.registry.register(grid.partition_of)
    arrays = ArrayRecord(get_task("digits").build_model().state_dict())
    train = ConfigRecord(config.client_config())
    for server_round in range(1, ROUND + 1):
        messages = list(strategy.configure_train(server_round, arrays, train, grid))
        replies = list(grid.send_and_receive(messages))
        bad = [r.error.reason for r in replies if r.has_error()]
        if bad:
            raise RuntimeError(f"{dict(keys)}: an honest client failed: {bad[0]}")
        if server_round < ROUND:
            arrays, _ = strategy.aggregate_train(server_round, replies)
    sent = {m.metadata.message_id: m for m in messages}
    return strategy, [(sent[r.metadata.reply_to_message_id], r) for r in replies]


def with_payload(sent: Message, reply: Message, record: str, data: bytes) -> Message:
    """``reply`` (to ``sent``) with its ``record`` (the update, or the shared signs) holding
    ``data``."""
    content = RecordDict(dict(reply.content.items()))
    content[record] = P.bytes_to_record(data, P.UPDATE if record == P.UPDATE
                                        else P.SHARED_SIGNS)
    return Message(content, reply_to=sent)


def fuzz_case(label: str, keys: Mapping[str, object], mutants: int, robust: str = "off",
              seed: int = 0) -> Outcome:
    """Run ``mutants`` mutant rounds of the run of ``keys`` (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="fedgc-fuzz-") as tmp:
        base, pairs = honest_round(keys, robust, Path(tmp), seed)
        replies = [reply for _, reply in pairs]
        rng = np.random.default_rng([seed, 35])
        out = Outcome(label)
        bound = base.checker.bound(ROUND, base._round.material if base._round else None)

        def peak(data: bytes) -> float:
            try:
                return base.checker.codec.decode(data, bound).max_abs()
            except DecodeError:
                return -1.0

        payloads = [P.record_to_bytes(r.content.array_records[P.UPDATE], P.UPDATE)
                    for r in replies]
        fields = [live_fields(d, peak) for d in payloads]
        started = time.perf_counter()
        while out.mutants < mutants:
            hostile = sorted(rng.choice(CLIENTS, 1 if rng.random() < 0.7 else 2, replace=False))
            round_replies = list(replies)
            for i in hostile:
                record, data, live = P.UPDATE, payloads[i], fields[i]
                shared = replies[i].content.array_records.get(P.SHARED)
                if shared is not None and rng.random() < 0.3:
                    record, data, live = P.SHARED, P.record_to_bytes(shared, P.SHARED_SIGNS), []
                _, mutant = mutate(data, rng, live)
                round_replies[i] = with_payload(pairs[i][0], replies[i], record, mutant)
            strategy = copy.deepcopy(base)
            checked = strategy.check_replies(ROUND, round_replies)
            arrays, _ = strategy.aggregate_checked(ROUND, checked)
            rows = {r.client_key: r for r in strategy.client_rows[-CLIENTS:]}
            honest = {c.client_key for i, c in enumerate(checked) if i not in hostile}
            # The round after, as if every client sent its honest reply again: what an accepted
            # mutant left (the momentum buffer, the model) must not fail it either.
            after, _ = strategy.aggregate_checked(ROUND, strategy.check_replies(ROUND, replies))
            after_rows = strategy.client_rows[-CLIENTS:]
            for i in hostile:
                c = checked[i]
                out.mutants += 1
                if c.status == "valid":
                    out.accepted += 1
                else:
                    out.refused[_reason(c.reason)] += 1
            if arrays is None or any(rows[k].status != "aggregated" for k in honest) \
                    or after is None or any(r.status != "aggregated" for r in after_rows):
                out.stalls += 1
                if not out.first_stall:
                    out.first_stall = "; ".join(f"{r.client_key}: {r.status} {r.reason}"
                                                for r in [*rows.values(), *after_rows])
        out.seconds = time.perf_counter() - started
        return out


def _reason(text: str) -> str:
    """A refusal's kind: its text up to the first colon, without numbers and names."""
    head = re.sub(r" \(.*?\)", "", text.split(":")[0])
    return re.sub(r"'[^']*'", "'...'", re.sub(r"\d+", "N", head))


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=10_000, help="mutants per method")
    parser.add_argument("--methods", default="", help="comma-separated (default: every "
                        "registered method)")
    parser.add_argument("--robust", default="off", choices=("off", "on"),
                        help="the run's defences (off: plain FedAvg)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(None if argv is None else list(argv))
    logging.getLogger("flwr").setLevel(logging.ERROR)  # a log line per refused reply
    print(f"reply fuzz: {args.mutants} mutants per case, robust={args.robust}, round {ROUND} "
          f"of digits, {CLIENTS} clients per round, seed {args.seed}", flush=True)
    stalls = 0
    for label, keys in cases([m for m in args.methods.split(",") if m]).items():
        outcome = fuzz_case(label, keys, args.mutants, args.robust, args.seed)
        print(outcome.line(), flush=True)
        if outcome.first_stall:
            print(f"  first stall: {outcome.first_stall}", flush=True)
        stalls += outcome.stalls
    return 1 if stalls else 0


if __name__ == "__main__":
    raise SystemExit(main())
