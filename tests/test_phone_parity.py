"""A phone runs a simulated client's round: the same minibatches, optimizer, densities and signs.

The reference phone (``android_bridge.phone``) and ``client.app`` are given the same train
messages of a default run (client momentum 0.5, ``dgc.small_density`` 0.03, the sign channel,
int8 patches broadcast): they must send the same bytes, update and signs, round after round,
also after a round the server did not aggregate (both fold it back). The phone trains with
``train_step.pte`` in ExecuTorch, whose kernels sum in another order than eager torch (about
1e-8 apart, docs/android.md); here its trainer is swapped for eager torch running the same
steps, so that what is compared is everything else: the batches, the optimizer's settings, the
pseudo-gradient, the fold-back, the encoder program with two densities, the signs. The training
step itself is compared with ``fedgc.training.train_locally`` separately, within 1e-5.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from android_bridge.shuffle import MT19937, local_batches, randperm
from dgc import SparseUpdate
from fedgc.training import round_seed, train_locally

torch.set_num_threads(1)


def test_randperm_is_torchs_draw_for_draw():
    for seed in (0, 5489, 2**40 + 17, round_seed(3, 7, 5)):
        generator, ours = torch.Generator().manual_seed(seed), MT19937(seed)
        # Successive permutations continue one stream across the generator's 624-word refills.
        for n in (1, 2, 37, 700, 1000):
            assert np.array_equal(torch.randperm(n, generator=generator).numpy(),
                                  randperm(n, ours)), (seed, n)


@pytest.mark.parametrize("n,batch,epochs,steps", [(23, 5, 2, 0), (10, 10, 1, 0), (7, 3, 1, 9)])
def test_local_batches_are_train_locallys(n, batch, epochs, steps):
    """The phone's minibatches: the indices fedgc.training.train_locally takes, step by step
    (a smaller last batch of each epoch, local_steps wrapping into a new permutation)."""
    seen: list[list[int]] = []

    def loss(model, x, y):
        seen.append([int(v) for v in x[:, 0]])
        return model(x).sum()

    x = torch.arange(n, dtype=torch.float32)[:, None]
    train_locally(torch.nn.Linear(1, 1), x, torch.zeros(n, dtype=torch.int64), loss, lr=0.1,
                  batch_size=batch, local_epochs=epochs, local_steps=steps, seed=11)
    ours = [[int(i) for i in b] for b in local_batches(n, batch, epochs, steps, 11)]
    assert ours == seen


def _same_steps(phone, simulated, codec, policy, steps: list) -> object:
    """Compress each step's ``(gradients, epoch)`` or ``(gradients, epoch, masks)`` (the
    round's material, TCS's masks; sequences 1, 2, ...) on the phone's host encoder and the
    simulated client's compressor: the same bytes and residual after each, the second step
    folded back by both (not aggregated) when they keep a residual. The phone's last
    update."""
    for sequence, (grads, epoch, *material) in enumerate(steps, start=1):
        masks = material[0] if material else None
        if material:
            simulated.masks = dict(masks or {})  # the round's, as a TCS client's compressor
        ours = phone.compress(grads, policy, epoch, sequence, masks)
        want = simulated.compress({n: torch.from_numpy(g) for n, g in grads.items()}, epoch,
                                  sequence)
        assert codec.encode(ours) == codec.encode(want), sequence
        if sequence == 2 and phone.keeps_residual:  # not aggregated: both fold it back whole
            phone.restore(ours)
            # The client folds back each part of its payload (client.state: pending_parts).
            masked = getattr(want, "masked", None)
            for part in [want, *([SparseUpdate(masked, sequence)] if masked else [])]:
                simulated.restore(part)
        for name, v in simulated.residual().items():
            assert np.array_equal(phone.residual[name], v.numpy()), (sequence, name)
        assert set(phone.residual) == set(simulated.residual()), sequence
    return ours


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16", "float32"])
def test_the_phones_random_k_sends_a_simulated_clients_bytes(value_dtype):
    """``android_bridge.host_encoders`` (numpy on the phone) against randk's simulated client
    (``RandomKCompressor``): the same ``FGCR`` bytes and residual, round after round, with a
    tensor sent whole, a warm-up density, a value beyond float16 and an update folded back."""
    from android_bridge.host_encoders import SeededEncoder
    from fedgc.methods.randk import RandomKCodec, client_seed
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "randk", "density": 0.05, "seed": 7,
                               "dgc.value_dtype": value_dtype, "dgc.warmup_rounds": 2})
    method, t = run.method, run.train
    policy = method.phone_config(t)
    task = method.phone_task(t, 3)
    assert task == {"encoder": "randk", "payload": "seeded", "seed": client_seed(t, 3)}
    simulated = method.compressor(t, 3)
    phone = SeededEncoder(task["seed"])
    codec = RandomKCodec()
    shapes = {"fc1.weight": (40, 30), "fc1.bias": (40,), "fc2.weight": (20, 40)}
    rng = np.random.default_rng(0)
    steps = []
    for sequence in range(1, 5):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        grads["fc2.weight"][0, :3] = [1e5, -7e4, 3.0]  # beyond float16's range
        steps.append((grads, float(sequence - 1)))
    ours = _same_steps(phone, simulated, codec, policy, steps)
    # below dgc.min_sparse_numel: whole; the others at the density after warm-up (5%)
    assert [t.nnz for t in ours.tensors.values()] == [60, 40, 40]


def test_the_phones_ef_sign_sends_a_simulated_clients_bytes():
    """``android_bridge.host_encoders.SignsEncoder`` against efsign's simulated client
    (``EFSignCompressor``): the same ``FGCB`` bytes (signs and float32 scales) and residual,
    round after round, with an update folded back and a tensor of zeros (scale 0)."""
    from android_bridge.host_encoders import SignsEncoder, host_encoder
    from fedgc.methods.efsign import SignsCodec
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "efsign"})
    method, t = run.method, run.train
    phone = host_encoder(method.phone_task(t, 3))
    assert isinstance(phone, SignsEncoder)
    simulated = method.compressor(t, 3)
    codec = SignsCodec()
    shapes = {"fc1.weight": (40, 30), "fc1.bias": (40,), "zeros": (7,)}
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(4):
        grads = {n: rng.standard_normal(s).astype(np.float32) * 1e-3 for n, s in shapes.items()}
        grads["zeros"][:] = 0.0
        steps.append((grads, 0.0))
    ours = _same_steps(phone, simulated, codec, method.phone_config(t), steps)
    assert ours.scales["zeros"] == 0.0 and ours.scales["fc1.weight"] > 0


def test_the_phones_vote_sends_a_simulated_clients_bytes():
    """``VoteEncoder`` against signvote's simulated client (``VoteCompressor``): the same
    ``FGCB`` bytes, exact zeros by the same coins, round after round; nothing kept."""
    from android_bridge.host_encoders import VoteEncoder, host_encoder
    from fedgc.methods.signvote import VoteCodec
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "signvote", "seed": 4})
    method, t = run.method, run.train
    phone = host_encoder(method.phone_task(t, 2))
    assert isinstance(phone, VoteEncoder) and phone.seed == (4 << 32) + 2
    simulated = method.compressor(t, 2)
    rng = np.random.default_rng(2)
    for sequence in range(1, 4):
        grads = {"w": rng.standard_normal((30, 20)).astype(np.float32),
                 "zeros": np.zeros(64, np.float32)}
        ours = phone.compress(grads, method.phone_config(t), 0.0, sequence)
        want = simulated.compress({n: torch.from_numpy(g) for n, g in grads.items()}, 0.0,
                                  sequence)
        assert VoteCodec().encode(ours) == VoteCodec().encode(want), sequence
        coins = ours.tensors["zeros"].values
        assert 0 < int((coins < 0).sum()) < 64  # a coin each, not one sign for all
    assert phone.residual == {} and not phone.keeps_residual


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error-feedback"])
def test_the_phones_qsgd_sends_a_simulated_clients_bytes(error_feedback):
    """``QuantizedEncoder`` (numpy on the phone) against qsgd's simulated client
    (``QSGDCompressor``): the same ``FGCQ`` bytes (norms, gaps, signs, levels) from the same
    draws of ``default_rng([client seed, round])``, round after round, with a last bucket cut
    short, a tensor of zeros (norm 0), one smaller than a bucket and one the phone rounds in
    two chunks (QSGD_CHUNK); a residual, folded back, with error feedback only."""
    from android_bridge.host_encoders import QSGD_CHUNK, QuantizedEncoder, host_encoder
    from fedgc.methods.qsgd import LevelsCodec, qsgd_seed
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "qsgd", "seed": 6, "qsgd.levels": 4,
                               "qsgd.bucket_size": 64, "qsgd.error_feedback": error_feedback})
    method, t = run.method, run.train
    task = method.phone_task(t, 5)
    assert task == {"encoder": "qsgd", "payload": "levels", "seed": qsgd_seed(t, 5),
                    "bucket": 64, "levels": 4, "error_feedback": error_feedback}
    phone = host_encoder(task)
    assert isinstance(phone, QuantizedEncoder) and phone.seed == (6 << 32) + 5
    assert phone.keeps_residual == method.keeps_residual == error_feedback
    shapes = {"fc1.weight": (30, 21), "fc1.bias": (30,), "zeros": (100,),
              "chunks": (QSGD_CHUNK + 70,)}
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(4):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        grads["zeros"][:] = 0.0
        steps.append((grads, 0.0))
    ours = _same_steps(phone, method.compressor(t, 5), LevelsCodec(64, 4),
                       method.phone_config(t), steps)
    assert ours.tensors["zeros"].nnz == 0 and ours.tensors["fc1.weight"].nnz > 0
    assert ours.norms["fc1.weight"].numel() == 10  # 630 entries in buckets of 64


def test_the_phones_tcs_sends_a_simulated_clients_bytes():
    """``MaskedEncoder`` against tcs's simulated client (``TCSCompressor``): the same ``FGCV``
    bytes and residual, round after round: no mask in the first round (the top-k alone), then
    the round's masks (values without indices) and the top-k outside them, a tensor sent
    whole, float16 values beyond its range, magnitudes tied at the k-th (ties to the lower
    position on both) and an update folded back."""
    from android_bridge.host_encoders import MaskedEncoder, host_encoder, largest_positions
    from fedgc.methods.tcs import Budget, MaskedCodec, largest
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": "tcs", "density": 0.05, "tcs.topk_share": 0.5,
                               "dgc.min_sparse_numel": 100})
    method, t = run.method, run.train
    task = method.phone_task(t, 1)
    assert task == {"encoder": "tcs", "payload": "masked",
                    "budget": {"density": 0.05, "small_density": 0.05, "small_numel": 10_000,
                               "share": 0.5}}
    phone = host_encoder(task)
    assert isinstance(phone, MaskedEncoder) and phone.budget == Budget(0.05, 0.05, 10_000, 0.5)
    shapes = {"w": (40, 30), "b": (40,), "v": (20, 10)}
    rng = np.random.default_rng(4)
    steps = []
    for sequence in range(1, 5):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        grads["w"][0, :3] = [1e5, -7e4, 3.0]  # beyond float16's range
        grads["v"][:] = np.where(np.arange(200).reshape(20, 10) % 7 == 0, 0.5, 0.001)
        masks = None if sequence == 1 else {
            "w": np.sort(rng.choice(1200, 60, replace=False)).astype(np.int64),
            "v": np.arange(0, 200, 20, dtype=np.int64)}
        steps.append((grads, 0.0, masks))
    ours = _same_steps(phone, method.compressor(t, 1), MaskedCodec(), method.phone_config(t),
                       steps)
    assert ours.masked["w"].nnz == 60 and ours.tensors["w"].nnz == 30
    assert ours.tensors["b"].nnz == 40  # 1-D, below dgc.min_sparse_numel: whole
    # The rule both sides follow among ties (round 1's 0.5 entries of v straddle the k-th)
    score = np.tile(np.float32([3.0, 1.0, 1.0, 0.5]), 4)
    for k in range(17):
        want = largest(torch.from_numpy(score), k)
        assert largest_positions(score, k).tolist() == want.tolist(), k
    assert largest_positions(score, 6).tolist() == [0, 1, 2, 4, 8, 12]


@pytest.mark.parametrize("explore,on_grid", [(0.0, False), (0.25, True)],
                         ids=["displacement", "explored-on-grid"])
def test_the_phones_ranked_sets_are_a_simulated_clients(explore, on_grid):
    """dgc.shared_rank = displacement (issue 39): the server's rank request carries only each
    set's size; the phone (``android_bridge.phone.derive_sets``, numpy arrays of the model it
    trains on and the version 0 its export builds) derives the sets the simulated client
    derives (``DGC.hold_material``) and the server planned, over rounds whose model moves, with
    ties (entries that never moved) and, with dgc.shared_explore, the seeded draw; a rank
    request on another model, or without version 0's tensors, is refused, named."""
    import dgc
    from android_bridge.phone import derive_sets
    from dgc.int8_grid import round_initial
    from fedgc.methods.dgc import DisplacementSets, RankRequest
    from fedgc.settings import RunConfig

    method = RunConfig.from_flat({"dgc.shared_rank": "displacement"}).method
    g = torch.Generator().manual_seed(5)
    initial = {"w": torch.randn(40, 30, generator=g) * 0.05, "v": torch.randn(300, generator=g),
               "b": torch.zeros(40)}
    version0 = round_initial(initial) if on_grid else initial
    counts = {"w": 36, "v": 9}
    numels = {n: t.numel() for n, t in initial.items()}
    server = DisplacementSets(counts, numels,
                              {n: round(explore * k) for n, k in counts.items()})
    model = {n: t.clone() for n, t in version0.items()}
    rounds = 0
    for server_round in range(1, 5):
        server.hold(model, server_round - 1, on_grid)
        planned = server.plan(server_round)
        if planned is not None:
            data, masks = planned
            material = method.read_material(data, numels)
            assert isinstance(material, RankRequest) and material.initial_on_grid == on_grid
            _, simulated = method.hold_material(data, material, model, lambda: dict(initial))
            phone = derive_sets(data, {n: t.numpy() for n, t in model.items()},
                                {n: t.numpy() for n, t in version0.items()})
            assert set(phone) == set(simulated) == set(masks) == set(counts), server_round
            for name in counts:
                assert np.array_equal(phone[name], simulated[name]), (server_round, name)
                assert np.array_equal(phone[name], np.asarray(masks[name])), server_round
                assert len(phone[name]) == counts[name]
            rounds += 1
        # A few entries move a lot, a few a little (ties among the rest: never moved).
        for t in model.values():
            idx = torch.randperm(t.numel(), generator=g)[:25]
            t.view(-1)[idx] += torch.randn(25, generator=g) * 0.1
    assert rounds == (4 if explore else 3)  # version 0 has not moved: no set without a draw
    data, _ = server.plan(5)
    arrays = {n: t.numpy() for n, t in model.items()}
    with pytest.raises(dgc.DecodeError):
        derive_sets(data, {**arrays, "w": np.zeros(7, np.float32)}, arrays)
    with pytest.raises(dgc.StateError, match="version 0 lacks.*'v'"):
        derive_sets(data, arrays, {"w": arrays["w"]})


class _NumpyGrads:
    """A compressor with the exported encoder's interface (numpy gradients in): the stand-in
    for ``PteEncoder``, whose equality with DGC's compressor the slow tests check."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def compress(self, grads, epoch=0.0, sequence=None):
        return self.inner.compress({n: torch.from_numpy(g) for n, g in grads.items()}, epoch,
                                   sequence)

    def residual(self):
        return self.inner.residual()

    def restore(self, update):
        self.inner.restore(update)


@pytest.mark.parametrize("keys", [{"dgc.shared_values": "grid", "dgc.shared_levels": 0.5},
                                  {"dgc.value_levels": 4.0},
                                  {"dgc.shared_values": "grid", "dgc.shared_levels": 0.5,
                                   "dgc.value_levels": 4.0},
                                  {"dgc.shared_values": "grid", "dgc.shared_levels": 0.5,
                                   "dgc.value_levels": 4.0, "dgc.shared_first": True}],
                         ids=["shared-grid", "value-levels", "both", "sets-first"])
def test_the_phones_grid_values_are_a_simulated_clients(keys):
    """dgc.shared_values = grid, dgc.value_levels and dgc.shared_first on a phone (issue 39,
    dgc_sets' items 2, 4 and 3): the host code around the exported encoder
    (``android_bridge.phone.encoder_round``: the sets taken first, the top-k's values on a
    grid, the rounding back into the residual, the sets' residual as grid values) sends the
    simulated client's update and side bytes and keeps its residual, four rounds running, the
    second folded back by both; with the sets first, round 1 has sets (the first round's
    remainder, put back after the top-k) and the sets differ from round to round."""
    from android_bridge.phone import encoder_round
    from fedgc.methods.dgc import dgc_config
    from fedgc.methods.sparsifier import split_compressor
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"density": 0.02, **keys})
    method, t = run.method, run.train
    own = method.own
    values = method.phone_values()
    first = "dgc.shared_first" in keys
    assert values == {**({"shared_levels": 0.5} if "dgc.shared_values" in keys else {}),
                      **({"levels": 4.0} if "dgc.value_levels" in keys else {}),
                      **({"first": 1.0} if first else {})}
    phone = _NumpyGrads(split_compressor(own, dgc_config(t, own), "tensor"))
    codec = method.codec(t)
    shapes = {"w": (60, 50), "b": (60,), "v": (30, 40)}
    rng = np.random.default_rng(8)
    state = None
    grids = 0
    for sequence in range(1, 5):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        masks = None if sequence == 1 and not first else {
            "w": np.sort(rng.choice(3000, 90, replace=False)).astype(np.int64),
            "v": np.arange(0, 1200, 37, dtype=np.int64)}
        simulated = method.compressor(t, 1, masks)
        if state is not None:
            simulated.load_state_dict(state)
        want = simulated.compress({n: torch.from_numpy(g) for n, g in grads.items()}, 0.0,
                                  sequence)
        part = method.side_part(simulated, masks, sequence)
        update, data, sent, side = encoder_round(phone, grads, 0.0, sequence, values, masks,
                                                 started=sequence > 1)
        assert data == codec.encode(want), sequence
        assert side == (b"" if part is None else part[0]), sequence
        grids += side[:4] not in (b"", b"FGCS")
        if sequence == 2:  # not aggregated: both fold back the update and the sets' part
            phone.restore(update)
            phone.restore(sent)
            simulated.restore(want)
            simulated.restore(method.read_side(side, masks, shapes))
        for name, v in simulated.residual().items():
            assert torch.equal(phone.residual()[name], v), (sequence, name)
        state = simulated.state_dict()
    assert grids == ((4 if first else 3) if "dgc.shared_values" in keys else 0)


class EagerTrainer:
    """``android_bridge.runtime.PteTrainer``'s interface on eager torch, doing exactly what
    ``fedgc.training.train_locally`` does with each batch."""

    def __init__(self, task, batch_size: int) -> None:
        self.task = task
        self.model = task.build_model()
        self.batch_shape = (batch_size, *task.input_shape)
        self.optimizer = None

    def set_parameters(self, params):
        self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in params.items()})

    def set_learning_rate(self, lr, momentum=0.0, weight_decay=0.0):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum,
                                         weight_decay=weight_decay)

    def train(self, batches):
        self.model.train()
        losses = []
        for x, y in batches:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task.training_loss(self.model, torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            self.optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def parameters(self):
        return {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}


# A default run's keys but a short one: every default a phone must follow is on (client
# momentum, the second density, the sign channel, int8 patches on a version 0 clients build).
# Phones fold an unaggregated update back whole (their encoder has no Method.unaggregated):
# dgc's simulated clients do too with unaggregated = keep.
SETTINGS = {"task": "digits", "num_clients": 4, "clients_per_round": 4, "rounds": 4,
            "seed": 2, "progress": False, "local_epochs": 1, "unaggregated": "keep"}
PHONE_KEY, DEVICE = 1, "phone-a"
TOKENS = {DEVICE: "p" * 16 + "-parity"}
DROPPED_ROUND = 2


@pytest.fixture(scope="module")
def parity_export(digits_phone_export):
    from tests.conftest import PHONE_RUN

    assert PHONE_RUN == {"task": SETTINGS["task"], "seed": SETTINGS["seed"]}
    return digits_phone_export


RANKED = {"dgc.shared_rank": "displacement", "downlink_context": True}
#: dgc_sets (issue 39: its switches, items 1 to 5 of docs/android.md's plan), which phones run.
#: Phones run the exact top-k (android_bridge.bridge_app._phone_config); the simulated client's
#: default, sampled, may keep fewer entries (from half of k), which the grid's residual met in
#: round 4 of this run.
DGC_SETS = {"method": "dgc_sets", "dgc.selection": "exact"}


@pytest.mark.slow
@pytest.mark.parametrize("keys", [{}, RANKED, DGC_SETS], ids=["default", "ranked", "dgc_sets"])
def test_phone_sends_the_bytes_a_simulated_client_sends(parity_export, tmp_path, keys):
    """The default run, and (issue 39) dgc on sets ranked by displacement from version 0,
    which the phone derives itself from the rank request, with patches ranked alike, which the
    phone joins on the model it holds (``ranked``: round 4's patch is ranked), and dgc_sets:
    besides, the sets taken before the top-k and answered with grid values, the top-k's values
    on a grid (host code around the exported encoder) and float16 bias vectors in the patches
    (differences the bridge turns into values)."""
    config = _run({**SETTINGS, **keys}, tmp_path)
    t = config.train
    own = config.method.own
    assert (t.client_momentum, own.small_density, own.shared_density) == (0.5, 0.03, 0.03)
    compared = _phone_and_simulated(parity_export, config, with_tasks=True)
    signs = _assert_same_bytes(compared)
    assert signs >= 2  # the sign channel had index sets to answer after the first rounds
    if keys:  # what the phone was sent: rank requests (and in `ranked`, a ranked patch)
        from dgc.signs.codec import RANK_MAGIC, SIGN_MAGIC

        tasks = [pair["task"] for pair in compared]
        assert sum(bytes(t.shared_mask[:4]) == RANK_MAGIC for t in tasks) == signs
        assert all(t.initial_sha256 for t in tasks if t.shared_mask or t.patch_context)
        grid = keys is DGC_SETS
        assert grid or any(t.patch_context for t in tasks), "no patch ranked by displacement"
        # the sets answered with grid values (dgc_sets) or signs
        assert all((pair["phone"][1][:4] != SIGN_MAGIC) == grid
                   for pair in compared if pair["phone"][1])


@pytest.mark.slow
def test_a_phone_sent_compact_patches_sends_the_bytes_a_simulated_client_sends(parity_export,
                                                                                tmp_path):
    """dgc_sets with downlink_compact (issue 39): the phone is sent its patches as compact
    messages (FGCK, the bias vectors' differences rewritten as values by the bridge in the same
    form), rebuilds the model sent bit for bit, and sends the simulated client's bytes; the
    downlink being lossless, its updates, signs and every round's accuracy are those of the run
    without the key, in fewer downlink bytes."""
    from android_bridge.proto import fedgc_bridge_pb2 as pb
    from fedgc.patching import is_compact

    runs = {}
    for compact in (False, True):
        rounds: list = []
        config = _run({**SETTINGS, **DGC_SETS, "downlink_compact": compact},
                      tmp_path / str(compact))
        compared = _phone_and_simulated(parity_export, config, with_tasks=True, rounds=rounds)
        assert _assert_same_bytes(compared) >= 2
        patches = [pair["task"].model_bytes for pair in compared
                   if pair["task"].encoding == pb.SPARSE_PATCH]
        assert len(patches) == SETTINGS["rounds"]  # a patch every round, on version 0 first
        assert all(is_compact(p) == compact for p in patches)
        runs[compact] = compared, rounds, [len(p) for p in patches]
    (plain, plain_rounds, plain_bytes), (compact, compact_rounds, compact_bytes) = (
        runs[False], runs[True])
    for a, b in zip(plain, compact, strict=True):
        assert a["phone"][:2] == b["phone"][:2]  # the same update and signs
    assert [r.accuracy for r in plain_rounds] == [r.accuracy for r in compact_rounds]
    assert all(c < p for c, p in zip(compact_bytes, plain_bytes, strict=True)), (
        compact_bytes, plain_bytes)
    print(f"\nthe phone's downlink bytes per round: update messages {plain_bytes}, compact "
          f"{compact_bytes}; the simulated client's: {[p['sent_bytes'] for p in plain]}, "
          f"{[p['sent_bytes'] for p in compact]}; accuracy "
          f"{[r.accuracy for r in compact_rounds]}")


@pytest.mark.slow
@pytest.mark.parametrize("keys", [{"method": "randk", "density": 0.05}, {"method": "efsign"},
                                  {"method": "signvote"}, {"method": "qsgd"},
                                  {"method": "tcs", "density": 0.05}],
                         ids=["randk", "efsign", "signvote", "qsgd", "tcs"])
def test_a_host_encoder_phone_sends_the_bytes_a_simulated_client_sends(parity_export, tmp_path,
                                                                       keys):
    """randk, efsign, signvote, qsgd and tcs (issue 39): the phone compresses on the host
    (android_bridge.host_encoders) with the training step of a dgc run's export (the same
    model, seed and batch) and sends the method's payload (FGCR, FGCB, FGCQ, FGCV), as a
    simulated client; no sign channel (tcs's mask reaches the phone as its task's
    shared_mask, from round 2 on, and is answered in the payload); the vote and qsgd (no
    error feedback by default) fold nothing back."""
    config = _run({**SETTINGS, **keys}, tmp_path)
    compared = _phone_and_simulated(parity_export, config)
    assert _assert_same_bytes(compared, config.method.keeps_residual) == 0
    if keys["method"] == "tcs":  # FGCV's masked tensor count: none before the first mask
        masked = [int.from_bytes(pair["phone"][0][5:9], "little") for pair in compared]
        assert masked[0] == 0 and min(masked[1:]) > 0, masked


def _run(settings: dict, tmp_path):
    from fedgc.settings import RunConfig

    return RunConfig.from_flat({**settings, "results_dir": str(tmp_path), "run_name": "parity"})


def _assert_same_bytes(compared: list[dict], folds_back: bool = True) -> int:
    """Each round's update, signs and metrics alike on the phone and the simulated client (the
    round after the dropped one folded it back, when the method keeps a residual); how many
    rounds carried signs."""
    from fedgc import protocol as P

    assert len(compared) == SETTINGS["rounds"]
    signs = 0
    for server_round, pair in enumerate(compared, start=1):
        (update, shared, metrics), (p_update, p_shared, p_metrics) = (pair["simulated"],
                                                                      pair["phone"])
        assert p_update == update, f"round {server_round}: the updates differ"
        assert p_shared == shared, f"round {server_round}: the signs differ"
        signs += shared is not None
        # The reply's metrics (fedgc.protocol.REPLY_METRICS; restored only when not 0) but the
        # time the round took.
        for key in ("num-examples", "train_loss", P.RESTORED):
            assert p_metrics.get(key) == metrics.get(key), (server_round, key)
        # The round after the dropped one folded that update back, on both.
        folded = folds_back and server_round == DROPPED_ROUND + 1
        assert metrics.get(P.RESTORED, 0) == int(folded), server_round
    return signs


def _phone_and_simulated(parity_export, config, with_tasks: bool = False,
                         rounds: list | None = None) -> list[dict]:
    """Run ``config`` on a LocalGrid whose client PHONE_KEY is both a reference phone behind
    the bridge and a simulated client given a copy of each train message; the pairs of
    replies (the phone's reply is the one aggregated; round DROPPED_ROUND's is lost), with
    ``with_tasks`` each round's task as the phone fetched it (``"task"``); ``rounds`` gets
    the run's round records (server.records.RoundRecord)."""
    from android_bridge.bridge import PhoneBridge
    from android_bridge.bridge_app import make_bridge_app
    from android_bridge.phone import ReferencePhone
    from client.app import app as client_app
    from client.app import client_data, client_key
    from fedgc import protocol as P
    from server.app import run_server
    from server.local_grid import LocalGrid
    from tasks import get_task

    t = config.train
    task = get_task("digits")
    x, y = client_data(t, PHONE_KEY, None)  # what client.app trains on for that key
    compared: list[dict] = []
    fetched: list = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with PhoneBridge(TOKENS, "127.0.0.1:0") as bridge:
        phone = ReferencePhone(parity_export, DEVICE, TOKENS[DEVICE], f"127.0.0.1:{bridge.port}",
                               x.numpy(), y.numpy())
        phone.trainer = EagerTrainer(task, t.batch_size)

        def serve() -> None:
            try:
                phone.register()
                while not stop.is_set():
                    try:
                        task = phone.wait_for_task(0.5)
                        fetched.append(task)
                        phone.run_round(task)
                    except TimeoutError:
                        continue
            except BaseException as ex:  # reported to the test thread
                errors.append(ex)

        worker = threading.Thread(target=serve)
        worker.start()
        held: dict = {}  # the model the bridge app sent the phone, per device
        bridge_app = make_bridge_app(bridge, {PHONE_KEY: DEVICE}, timeout_s=120, held=held)

        def tee(msg, context):
            if client_key(context) != PHONE_KEY or msg.metadata.message_type != "train":
                return client_app(msg, context)
            simulated = client_app(copy.deepcopy(msg), context)
            reply = bridge_app(msg, context)
            # The phone rebuilt the model sent (a patch, ranked or not, on the one it holds).
            sent = held[DEVICE].model
            assert all(np.array_equal(phone.model[k], sent[k].numpy()) for k in sent), \
                f"round {len(compared) + 1}: the phone's model is not the one sent"
            # what the server sent the simulated client: its patch's bytes (or the dense model's)
            pair = {"sent_bytes": P.record_nbytes(msg.content.array_records[P.ARRAYS])}
            for name, r in (("simulated", simulated), ("phone", reply)):
                shared = r.content.array_records.get(P.SHARED)
                pair[name] = (P.record_to_bytes(r.content.array_records[P.UPDATE], P.UPDATE),
                              None if shared is None else
                              P.record_to_bytes(shared, P.SHARED_SIGNS),
                              dict(r.content.metric_records[P.METRICS]))
            compared.append(pair)
            return reply

        grid = LocalGrid(tee, t.num_clients, seed=3)

        def drop(reply):
            if not reply.has_content() or reply.metadata.message_type != "train":
                return reply
            if grid.partition_of[reply.metadata.src_node_id] == PHONE_KEY \
                    and reply.metadata.group_id == str(DROPPED_ROUND):
                return None  # lost on the way back: neither copy is aggregated
            return reply

        grid.intercept = drop
        try:
            run_server(grid, config, on_round=None if rounds is None else rounds.append)
        finally:
            stop.set()
            worker.join(30)
            phone.close()
    assert not errors, errors
    if with_tasks:
        assert len(fetched) == len(compared)
        for pair, task in zip(compared, fetched, strict=True):
            pair["task"] = task
    return compared


@pytest.mark.slow
def test_pte_training_step_follows_train_locally(parity_export):
    """``train_step.pte`` with ExecuTorch's SGD (momentum, weight decay, a smaller last batch)
    against ``fedgc.training.train_locally`` on the same batches: within 1e-5."""
    from android_bridge.runtime import PteTrainer
    from tasks import get_task

    task = get_task("digits")
    idx = torch.arange(23)  # batch 10: 10, 10, 3 per epoch
    torch.manual_seed(0)
    model = task.build_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eager = train_locally(model, task.train_x[idx], task.train_y[idx], task.training_loss,
                          lr=0.1, batch_size=10, local_epochs=2, local_steps=0, momentum=0.5,
                          weight_decay=1e-3, seed=4)
    trainer = PteTrainer(parity_export)
    trainer.set_parameters({k: v.numpy() for k, v in start.items()})
    trainer.set_learning_rate(0.1, momentum=0.5, weight_decay=1e-3)
    x, y = task.train_x[idx].numpy(), task.train_y[idx].numpy()
    losses = trainer.train((x[b], y[b]) for b in local_batches(23, 10, 2, 0, 4))
    assert len(losses) == eager.steps == 6
    local = trainer.parameters()
    for name, g in eager.pseudo_gradient.items():
        phone = start[name].numpy() - local[name]
        assert np.abs(phone - g.numpy()).max() < 1e-5, name
    assert abs(sum(losses) / len(losses) - eager.train_loss) < 1e-5
