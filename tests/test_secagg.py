"""Secure aggregation (fedgc/privacy/secagg): SecAgg+ sums masked vectors exactly, recovers a
dropout at each stage from the shares, refuses below the threshold, rejects bad and replayed
messages, hides every single vector from a server that keeps all it receives, and the cost
model gives each message's bytes."""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
from scipy import stats

from fedgc.privacy import FixedPoint
from fedgc.privacy.secagg import (
    BadMessage,
    ClientHandler,
    SecAggError,
    ServerSession,
    StageError,
    ThresholdError,
    client_bytes,
    crypto,
)
from fedgc.privacy.secagg.cost import STAGES, overhead_bytes
from fedgc.privacy.secagg.local import run_local
from fedgc.privacy.secagg.wire import (
    MASK_SEED,
    SELF_SEED,
    Forward,
    Keys,
    Masked,
    Neighbours,
    Reveal,
    Setup,
    Shares,
    Survivors,
)

BITS = 24


def _vectors(n: int, length: int, seed: int = 0, first: int = 100) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {first + i: rng.integers(0, 1 << BITS, length, dtype=np.uint64) for i in range(n)}


def _ring_sum(vectors: dict[int, np.ndarray], clients) -> np.ndarray:
    total = np.zeros(len(next(iter(vectors.values()))), dtype=np.uint64)
    for c in clients:
        total += vectors[c]
    return total & np.uint64((1 << BITS) - 1)


def test_the_masked_sum_equals_the_plain_sum_within_the_fixed_point_bound():
    rng = np.random.default_rng(1)
    floats = {10 + i: rng.uniform(-1.0, 1.0, 300) for i in range(7)}
    fp = FixedPoint.for_clients(7, clip=1.0, value_bits=16)
    ring = {c: fp.encode(x, rng)[0] for c, x in floats.items()}
    run = run_local(ring, fp.modulus_bits, rng=random.Random(0))
    assert run.error is None and run.session.summed == tuple(sorted(floats))
    # Exact in the ring: the masks cancel to the last bit.
    total = np.zeros(300, dtype=np.uint64)
    for v in ring.values():
        total += v
    assert np.array_equal(run.total, total & np.uint64(fp.modulus - 1))
    # And the floats within the fixed point's bound (7 steps), not exactly.
    decoded = fp.decode_sum(run.total, 7)
    error = np.abs(decoded - sum(floats.values()))
    assert error.max() < fp.error_bound(7) and error.max() > 0


@pytest.mark.parametrize("stage", STAGES)
def test_a_dropout_at_each_stage_is_recovered_by_the_shares(stage):
    vectors = _vectors(12, 200)
    gone = {101, 107}
    # A sparse ring: 6 neighbours each, 4 of them rebuild a seed.
    run = run_local(vectors, BITS, drop={c: stage for c in gone}, neighbours=6, threshold=4,
                    rng=random.Random(3))
    assert run.error is None
    if stage == "unmask":  # they sent their vectors: in the sum, their self masks rebuilt
        assert run.session.summed == tuple(sorted(vectors))
    else:
        assert set(run.session.summed) == set(vectors) - gone
        assert all(run.session.dropped[c].startswith({
            "setup": "setup", "share_keys": "share keys",
            "collect_masked_vectors": "masked vector"}[stage]) for c in gone)
    assert np.array_equal(run.total, _ring_sum(vectors, run.session.summed))


def test_dropouts_at_every_stage_at_once():
    vectors = _vectors(16, 100, seed=2)
    drop = {100: "setup", 103: "share_keys", 106: "collect_masked_vectors", 109: "unmask",
            112: "collect_masked_vectors"}
    run = run_local(vectors, BITS, drop=drop, rng=random.Random(4))  # everyone's neighbour
    assert run.error is None
    assert set(run.session.summed) == set(vectors) - {100, 103, 106, 112}
    assert np.array_equal(run.total, _ring_sum(vectors, run.session.summed))


def test_a_cluster_of_half_a_neighbourhood_cascades_and_the_session_refuses_cleanly():
    """A client needs a strict majority of its neighbours; on the ring its neighbours share most
    of its neighbourhood, so losing half of one (k/2 of them at setup) prunes it, then them, and
    so on: the session ends with no sum. Dropouts scattered over the ring do not cascade."""
    vectors = _vectors(30, 10, seed=5)
    probe = ServerSession(list(vectors), 10, BITS, neighbours=6, threshold=4,
                          rng=random.Random(1))
    around = probe.graph[107]
    run = run_local(vectors, BITS, drop={c: "setup" for c in around[:3]}, neighbours=6,
                    threshold=4, rng=random.Random(1))
    assert isinstance(run.error, ThresholdError) and "min_survivors" in str(run.error)
    assert "fewer than 4 neighbours left" in run.session.dropped[107]
    run = run_local(vectors, BITS, drop={around[0]: "setup", around[5]: "setup"}, neighbours=6,
                    threshold=4, rng=random.Random(1))
    assert run.error is None and len(run.session.summed) == 28
    assert np.array_equal(run.total, _ring_sum(vectors, run.session.summed))


def test_below_the_threshold_the_session_refuses_with_no_sum():
    vectors = _vectors(10, 50, seed=6)
    probe = ServerSession(list(vectors), 50, BITS, neighbours=4, threshold=3,
                          rng=random.Random(8))
    victim = 105
    # Two of its four neighbours send no vector: its self mask has 2 holders of 3 needed.
    run = run_local(vectors, BITS, drop={c: "collect_masked_vectors"
                                         for c in probe.graph[victim][:2]},
                    neighbours=4, threshold=3, rng=random.Random(8))
    assert isinstance(run.error, ThresholdError) and run.total is None
    assert "need 3 shares" in str(run.error)
    assert run.session.stage == "failed"
    with pytest.raises(StageError):
        run.session.result({})
    # After the vectors: holders that never reveal.
    run = run_local(vectors, BITS, drop={c: "unmask" for c in probe.graph[victim][:2]},
                    neighbours=4, threshold=3, rng=random.Random(8))
    assert isinstance(run.error, ThresholdError) and "good shares" in str(run.error)
    # Too few clients at all.
    run = run_local(vectors, BITS, drop={c: "setup" for c in list(vectors)[:8]})
    assert isinstance(run.error, ThresholdError) and "min_survivors" in str(run.error)


def test_a_session_refuses_parameters_a_client_would_refuse():
    with pytest.raises(SecAggError, match="strict majority"):
        ServerSession(range(10), 5, BITS, neighbours=4, threshold=2)
    with pytest.raises(ValueError, match="even number"):
        ServerSession(range(10), 5, BITS, neighbours=5, threshold=3)
    with pytest.raises(SecAggError, match="modulus_bits"):
        ServerSession(range(10), 5, 63)
    with pytest.raises(SecAggError, match="distinct"):
        ServerSession([1, 1, 2], 5, BITS)


# ---------------------------------------------------------------------- hostile replies
def _replace(reply: bytes, kind, **fields) -> bytes:
    decoded = kind.decode(reply) if kind is not Masked else Masked.decode(reply, 40, BITS)
    return dataclasses.replace(decoded, **fields).encode()


def _bad_share(reply: bytes) -> bytes:
    reveal = Reveal.decode(reply)
    owner, kind, share = reveal.records[0]
    forged = share[:4] + bytes(b ^ 1 for b in share[4:])
    return dataclasses.replace(reveal, records=((owner, kind, forged),
                                                *reveal.records[1:])).encode()


def _wrong_kind(reply: bytes) -> bytes:
    reveal = Reveal.decode(reply)
    owner, kind, share = reveal.records[0]
    other = MASK_SEED if kind == SELF_SEED else SELF_SEED
    return dataclasses.replace(reveal, records=((owner, other, share),
                                                *reveal.records[1:])).encode()


TAMPERED = {
    "garbage": ("setup", lambda r: os.urandom(len(r)), "bad magic"),
    "truncated": ("share_keys", lambda r: r[:-7], "checksum"),
    "a flipped bit": ("collect_masked_vectors", lambda r: r[:50] + bytes([r[50] ^ 4]) + r[51:],
                      "checksum"),
    "another session": ("setup", lambda r: _replace(r, Keys, session=os.urandom(16)),
                        "names session"),
    "a low-order public key": ("setup", lambda r: _replace(r, Keys, mask_key=bytes(32)),
                               "not a usable X25519 key"),
    "another client's id": ("share_keys", lambda r: _replace(r, Shares, client=7), "client 7"),
    "a missing target": ("share_keys",
                         lambda r: _replace(r, Shares, records=Shares.decode(r).records[1:]),
                         "go to"),
    "a short vector": ("collect_masked_vectors", lambda r: _replace(
        r, Masked, vector=Masked.decode(r, 40, BITS).vector[:-1]), "39 coordinates"),
    "a forged share": ("unmask", _bad_share, "not the one committed"),
    "a share of the wrong kind": ("unmask", _wrong_kind, "differ from those asked"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_hostile_reply_is_rejected_with_its_reason_and_the_rest_sum(case):
    stage, change, reason = TAMPERED[case]
    vectors = _vectors(9, 40, seed=9)
    hostile = 104

    def tamper(at: str, client: int, reply: bytes) -> bytes:
        return change(reply) if (at, client) == (stage, hostile) else reply

    run = run_local(vectors, BITS, neighbours=6, threshold=4, rng=random.Random(1),
                    tamper=tamper)
    assert run.error is None
    assert reason in run.session.rejected[hostile]
    # A rejected reveal leaves the hostile client's vector in the sum (it sent a good one);
    # before that, it is out.
    expected = set(vectors) - ({hostile} if stage != "unmask" else set())
    assert set(run.session.summed) == expected
    assert np.array_equal(run.total, _ring_sum(vectors, run.session.summed))


def test_a_client_that_deals_inconsistent_shares_is_named_and_the_round_refused():
    vectors = _vectors(6, 20, seed=10)

    def tamper(stage: str, client: int, reply: bytes) -> bytes:
        if (stage, client) != ("share_keys", 102):
            return reply
        shares = Shares.decode(reply)
        return dataclasses.replace(shares, seed_commitment=bytes(32)).encode()

    run = run_local(vectors, BITS, tamper=tamper, rng=random.Random(2))
    assert isinstance(run.error, SecAggError) and "client 102 dealt shares" in str(run.error)


# ---------------------------------------------------------------------- the client's checks
def _session_to_stage2(n: int = 6, length: int = 10):
    """A session driven by hand to the forwarded shares: (server, handlers, forward requests,
    the Shares replies)."""
    server = ServerSession(list(range(1, n + 1)), length, BITS, rng=random.Random(5))
    handlers = {c: ClientHandler(c, length) for c in server.clients}
    keys = {c: handlers[c].setup(m) for c, m in server.setup().items()}
    shares = {c: handlers[c].share_keys(m) for c, m in server.share_keys(keys).items()}
    return server, handlers, server.collect_masked_vectors(shares), shares


def test_a_client_rejects_foreign_replayed_and_misaddressed_ciphertexts():
    server, handlers, forwards, _ = _session_to_stage2()
    other, _, other_forwards, _ = _session_to_stage2()
    vector = np.zeros(10, dtype=np.uint64)
    mine = Forward.decode(forwards[1])
    # From another session: the session id rewritten to this one's, the ciphertext not.
    replayed = Forward(mine.session, Forward.decode(other_forwards[1]).records)
    with pytest.raises(BadMessage, match="do not authenticate"):
        handlers[1].masked_vector(replayed.encode(), vector)
    # Client 2's ciphertext from client 3, forwarded to client 1 as if from 3.
    to_two = dict(Forward.decode(forwards[2]).records)
    misaddressed = Forward(mine.session, ((3, to_two[3]),
                                          *(r for r in mine.records if r[0] != 3)))
    with pytest.raises(BadMessage, match="from client 3 to client 1 do not authenticate"):
        handlers[1].masked_vector(misaddressed.encode(), vector)
    with pytest.raises(BadMessage, match="not one of its neighbours"):
        handlers[1].masked_vector(Forward(mine.session, ((99, bytes(100)),)).encode(), vector)
    with pytest.raises(BadMessage, match="of session"):
        handlers[1].masked_vector(Forward(os.urandom(16), mine.records).encode(), vector)
    with pytest.raises(SecAggError, match="outside"):
        handlers[1].masked_vector(forwards[1], np.full(10, 1 << BITS, dtype=np.uint64))
    # None of that changed the handler: the right request still works.
    assert Masked.decode(handlers[1].masked_vector(forwards[1], vector), 10, BITS).client == 1


def test_a_client_refuses_requests_out_of_order_unsafe_or_twice():
    handler = ClientHandler(3, 10)
    setup = Setup(os.urandom(16), 1, 3, 10, 4, 3, 10, BITS)
    with pytest.raises(StageError):
        handler.share_keys(Neighbours(setup.session, ()).encode())
    with pytest.raises(BadMessage, match="strict majority"):
        handler.setup(dataclasses.replace(setup, threshold=2).encode())
    with pytest.raises(BadMessage, match="names client 4"):
        handler.setup(dataclasses.replace(setup, client=4).encode())
    with pytest.raises(BadMessage, match="length = 11"):
        handler.setup(dataclasses.replace(setup, length=11).encode())
    handler.setup(setup.encode())
    with pytest.raises(StageError, match="a second setup of session"):  # a replay mid-way
        handler.setup(setup.encode())
    key = crypto.public_bytes(crypto.key_pair(crypto.new_seed()))
    with pytest.raises(BadMessage, match="its own id among them: True"):
        handler.share_keys(Neighbours(setup.session, ((3, key, key),)).encode())
    others = tuple((p, crypto.public_bytes(crypto.key_pair(crypto.new_seed())),
                    crypto.public_bytes(crypto.key_pair(crypto.new_seed()))) for p in (4, 5))
    with pytest.raises(ThresholdError, match="fewer than the threshold 3"):
        handler.share_keys(Neighbours(setup.session, others).encode())
    # A new session replaces one the server gave up on.
    fresh = dataclasses.replace(setup, session=os.urandom(16))
    assert Keys.decode(handler.setup(fresh.encode())).session == fresh.session

    # Unmasking happens once: a second request could ask for the other kind of share.
    server, handlers, forwards, _ = _session_to_stage2()
    masked = {c: handlers[c].masked_vector(m, np.zeros(10, dtype=np.uint64))
              for c, m in forwards.items()}
    requests = server.unmask(masked)
    handlers[1].unmask(requests[1])
    flipped = Survivors.decode(requests[1])
    swapped = Survivors(flipped.session, (), flipped.active)
    with pytest.raises(StageError):
        handlers[1].unmask(swapped.encode())


def test_a_client_handler_goes_on_from_its_state_between_processes():
    vectors = _vectors(5, 30, seed=11)
    server = ServerSession(list(vectors), 30, BITS, rng=random.Random(6))
    handlers = {c: ClientHandler(c, 30) for c in vectors}

    def step(requests, call):
        out = {}
        for c, m in requests.items():
            out[c] = call(handlers[c], m, c)
            # Each message in a fresh process: the handler rebuilt from its state.
            handlers[c] = ClientHandler.from_state(handlers[c].state_dict())
        return out

    keys = step(server.setup(), lambda h, m, c: h.setup(m))
    shares = step(server.share_keys(keys), lambda h, m, c: h.share_keys(m))
    masked = step(server.collect_masked_vectors(shares),
                  lambda h, m, c: h.masked_vector(m, vectors[c]))
    reveals = step(server.unmask(masked), lambda h, m, c: h.unmask(m))
    assert np.array_equal(server.result(reveals), _ring_sum(vectors, vectors))
    with pytest.raises(BadMessage, match="does not read back"):
        ClientHandler.from_state({"client": 1})


# ---------------------------------------------------------------------- what the server learns
def _uniform(values: np.ndarray, bits: int) -> float:
    """The Kolmogorov-Smirnov p-value of ``values`` / 2^bits against U(0, 1)."""
    return stats.kstest(values.astype(np.float64) / (1 << bits), "uniform").pvalue


def test_one_masked_vector_is_indistinguishable_from_uniform():
    # The most telling input: a client whose update is all zeros (and one of small integers).
    vectors = _vectors(5, 4000, seed=12)
    vectors[100] = np.zeros(4000, dtype=np.uint64)
    vectors[101] = np.arange(4000, dtype=np.uint64) % 5
    seen: dict[int, bytes] = {}

    def keep(stage: str, client: int, reply: bytes) -> bytes:
        if stage == "collect_masked_vectors":
            seen[client] = reply
        return reply

    run = run_local(vectors, BITS, tamper=keep)
    assert run.error is None
    for client in (100, 101):
        y = Masked.decode(seen[client], 4000, BITS).vector
        # p below 1e-6 would reject uniformity; a fixed vector (unmasked) fails it outright.
        assert _uniform(y, BITS) > 1e-6
        assert _uniform(vectors[client], BITS) < 1e-6
        # Nor does the masked vector correlate with the input.
        assert abs(np.corrcoef(y.astype(float), vectors[101].astype(float))[0, 1]) < 0.1


def test_a_server_with_every_message_it_receives_cannot_unmask_one_client():
    """The server tries: with every reply it legitimately gets (no dropout), it rebuilds the
    target's self-mask seed from the revealed shares, strips the self mask and is left with
    the pairwise masks; it holds no share of the target's mask key seed, and the self-mask
    shares do not rebuild it."""
    vectors = _vectors(7, 2000, seed=13)
    target = 103
    vectors[target] = np.zeros(2000, dtype=np.uint64)
    seen: dict[tuple[str, int], bytes] = {}

    def keep(stage: str, client: int, reply: bytes) -> bytes:
        seen[(stage, client)] = reply
        return reply

    run = run_local(vectors, BITS, neighbours=4, threshold=3, rng=random.Random(9), tamper=keep)
    assert run.error is None
    session = run.session.session
    y = Masked.decode(seen[("collect_masked_vectors", target)], 2000, BITS).vector
    revealed = [(owner, kind, share) for (stage, _), reply in seen.items() if stage == "unmask"
                for owner, kind, share in Reveal.decode(reply).records if owner == target]
    # It holds the target's self-mask seed (the protocol gives it: the target sent its vector).
    self_shares = [s for _, kind, s in revealed if kind == SELF_SEED]
    seed = crypto.combine(self_shares)
    assert seed is not None
    stripped = (y - crypto.mask(crypto.self_mask_key(seed, session, target), 2000, BITS)) \
        & np.uint64((1 << BITS) - 1)
    # What is left is the pairwise masks: not the target's (zero) vector, uniform-looking.
    assert not np.array_equal(stripped, vectors[target])
    assert _uniform(stripped, BITS) > 1e-6
    # It never received a share of the target's mask key seed ...
    assert [kind for _, kind, _ in revealed] == [SELF_SEED] * len(revealed)
    # ... nor can the self-mask shares stand in for it.
    target_keys = Keys.decode(seen[("setup", target)])
    assert crypto.public_bytes(crypto.key_pair(seed)) != target_keys.mask_key
    # The shares travelled encrypted: a key of the server's own does not open them.
    ciphertext = Shares.decode(seen[("share_keys", target)]).records[0]
    intruder = crypto.key_pair(crypto.new_seed())
    key = crypto.agree(intruder, target_keys.cipher_key, session, b"shares", target,
                       ciphertext[0])
    with pytest.raises(BadMessage, match="do not authenticate"):
        crypto.open_shares(key, session, target, ciphertext[0], ciphertext[3])


def test_a_server_that_lies_about_a_dropout_gets_fewer_than_threshold_of_each_kind():
    """Asking half the target's neighbours for its self-mask share ('it sent its vector') and
    the other half for its mask key share ('it dropped') yields below the threshold of both:
    the threshold is a strict majority."""
    n, length = 9, 20
    server = ServerSession(list(range(1, n + 1)), length, BITS, neighbours=6, threshold=4,
                           rng=random.Random(10))
    handlers = {c: ClientHandler(c, length) for c in server.clients}
    keys = {c: handlers[c].setup(m) for c, m in server.setup().items()}
    shares = {c: handlers[c].share_keys(m) for c, m in server.share_keys(keys).items()}
    forwards = server.collect_masked_vectors(shares)
    for c, m in forwards.items():
        handlers[c].masked_vector(m, np.zeros(length, dtype=np.uint64))
    target = 5
    holders = sorted(server.graph[target])
    session = server.session
    got = {SELF_SEED: [], MASK_SEED: []}
    for i, h in enumerate(holders):
        # A client refuses to reveal with fewer active neighbours than the threshold, so the
        # lying server names enough of them active beside the lie.
        others = tuple(o for o in sorted(handlers[h].held) if o != target)[:3]
        request = (Survivors(session, (target, *others), ()) if i % 2 == 0
                   else Survivors(session, others, (target,)))
        for owner, kind, share in Reveal.decode(handlers[h].unmask(request.encode())).records:
            if owner == target:
                got[kind].append(share)
    assert len(got[SELF_SEED]) == 3 and len(got[MASK_SEED]) == 3  # each below 4
    target_keys = Keys.decode(keys[target])
    target_commitment = Shares.decode(shares[target]).seed_commitment
    self_seed = crypto.combine(got[SELF_SEED])
    assert self_seed is None or crypto.commit_seed(session, target, self_seed) != \
        target_commitment
    mask_seed = crypto.combine(got[MASK_SEED])
    assert mask_seed is None or len(mask_seed) != crypto.SEED_BYTES or \
        crypto.public_bytes(crypto.key_pair(mask_seed)) != target_keys.mask_key


def test_a_late_vector_of_a_client_counted_as_dropped_stays_hidden_by_its_self_mask():
    """Why the self mask: the server rebuilds a dropped client's mask key (as it must, to clean
    its neighbours' vectors); if that client's vector then arrives late, stripping its pairwise
    masks leaves it under its self mask, whose seed the server never gets."""
    n, length = 6, 2000
    server = ServerSession(list(range(1, n + 1)), length, BITS, rng=random.Random(11))
    handlers = {c: ClientHandler(c, length) for c in server.clients}
    keys = {c: handlers[c].setup(m) for c, m in server.setup().items()}
    shares = {c: handlers[c].share_keys(m) for c, m in server.share_keys(keys).items()}
    forwards = server.collect_masked_vectors(shares)
    late = 2
    zero = np.zeros(length, dtype=np.uint64)
    masked = {c: handlers[c].masked_vector(m, zero) for c, m in forwards.items()}
    on_time = {c: m for c, m in masked.items() if c != late}
    reveals = {c: handlers[c].unmask(m) for c, m in server.unmask(on_time).items()}
    server.result(reveals)
    with pytest.raises(StageError):  # the session has moved on: the late vector is refused
        server.unmask({late: masked[late]})
    mask_shares = [s for r in reveals.values() for o, k, s in Reveal.decode(r).records
                   if o == late and k == MASK_SEED]
    private = crypto.key_pair(crypto.combine(mask_shares[:server.threshold]))
    y = Masked.decode(masked[late], length, BITS).vector
    for peer in Forward.decode(forwards[late]).records:
        pk = Keys.decode(keys[peer[0]]).mask_key
        pairwise = crypto.mask(crypto.agree(private, pk, server.session, b"mask", late, peer[0]),
                               length, BITS)
        y = y - pairwise if late < peer[0] else y + pairwise
    y &= np.uint64((1 << BITS) - 1)
    assert not np.array_equal(y, zero) and _uniform(y, BITS) > 1e-6


# ---------------------------------------------------------------------- bytes
@pytest.mark.parametrize("length,bits", [(10, 20), (1000, 32), (777, 13)])
def test_the_cost_model_gives_each_message_s_bytes(length, bits):
    vectors = {c: np.ones(length, dtype=np.uint64) for c in range(20, 31)}
    run = run_local(vectors, bits, neighbours=6, threshold=4, rng=random.Random(12))
    assert run.error is None
    want = client_bytes(6, length, bits)
    assert all(run.bytes[c] == want for c in vectors)
    assert want["collect_masked_vectors"].up == 42 + (length * bits + 7) // 8
    assert overhead_bytes(6, length, bits) == 373 * 6 + 356
    # With dropouts, from the counts each client saw.
    drop = {21: "share_keys", 24: "collect_masked_vectors", 27: "unmask"}
    run = run_local(vectors, bits, drop=drop, rng=random.Random(12))  # everyone's neighbour
    assert run.error is None
    for c in set(vectors) - set(drop):
        assert run.bytes[c] == client_bytes(10, length, bits, **run.session.client_counts(c))
