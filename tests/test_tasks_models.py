"""Tests of the model builders and of training/evaluation on a real shipped dataset."""

import pytest
import torch

from tasks import MODELS, DataError, build_model, get_task


@pytest.fixture(autouse=True)
def _one_thread():
    # The test machines are shared; one intra-op thread is faster than contended threads here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("name", "input_shape", "num_classes", "batch"),
    [
        ("mlp", (784,), 10, torch.rand(4, 784)),
        ("mlp", (1, 8, 8), 10, torch.rand(4, 1, 8, 8)),
        ("cnn", (1, 28, 28), 10, torch.rand(4, 1, 28, 28)),
        ("cnn", (3, 32, 32), 10, torch.rand(4, 3, 32, 32)),
        ("lstm", (80,), 83, torch.randint(0, 83, (4, 80))),
    ],
)
def test_forward_shapes(name: str, input_shape: tuple, num_classes: int, batch) -> None:
    model = build_model(name, input_shape, num_classes)
    assert model(batch).shape == (4, num_classes)


def test_default_sizes() -> None:
    mlp = build_model("mlp", (784,), 10)
    assert sum(p.numel() for p in mlp.parameters()) == 784 * 200 + 200 + 200 * 10 + 10
    lstm = build_model("lstm", (80,), 80)
    assert lstm.lstm.hidden_size == 128 and lstm.lstm.num_layers == 2
    assert lstm.embedding.embedding_dim == 8
    assert build_model("mlp", (64,), 10, hidden=(32, 16)).net[1].out_features == 32


def test_weights_deterministic_under_manual_seed() -> None:
    torch.manual_seed(5)
    a = build_model("cnn", (1, 28, 28), 10).state_dict()
    torch.manual_seed(5)
    b = build_model("cnn", (1, 28, 28), 10).state_dict()
    torch.manual_seed(6)
    c = build_model("cnn", (1, 28, 28), 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_model_and_bad_shapes() -> None:
    with pytest.raises(DataError, match=r"unknown model 'resnet'.*\['mlp', 'cnn', 'lstm'\]"):
        build_model("resnet", (784,), 10)
    with pytest.raises(DataError, match=r"'cnn' needs image inputs \(C, H, W\)"):
        build_model("cnn", (784,), 10)
    with pytest.raises(DataError, match="at least 4x4"):
        build_model("cnn", (1, 2, 2), 10)
    with pytest.raises(DataError, match="bad option for model 'mlp'"):
        build_model("mlp", (784,), 10, depth=3)
    assert MODELS == ("mlp", "cnn", "lstm")


def test_get_task_rejects_bad_names_and_combinations() -> None:
    with pytest.raises(DataError, match=r"unknown dataset 'imagenet'.*'mnist5k'"):
        get_task("imagenet")
    with pytest.raises(DataError, match=r"unknown model 'vit'"):
        get_task("mnist5k", model="vit")
    with pytest.raises(DataError, match="model 'lstm' does not fit dataset 'digits'"):
        get_task("digits", model="lstm")
    with pytest.raises(DataError, match=r"unknown option\(s\) \['alpha'\] for dataset 'digits'"):
        get_task("digits", alpha=0.5)
    with pytest.raises(DataError, match="bad option for model 'mlp'"):
        get_task("digits", model_options={"width": 3})


def test_sgd_steps_on_mnist5k_reduce_the_loss() -> None:
    torch.manual_seed(0)
    task = get_task("mnist5k", seed=0)
    model = task.build_model()
    x, y = task.train_x[:512], task.train_y[:512]
    before, acc_before = task.evaluate(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(40):
        batch = slice((step % 8) * 64, (step % 8 + 1) * 64)
        opt.zero_grad()
        task.loss_fn(model(x[batch]), y[batch]).backward()
        opt.step()
    after, acc_after = task.evaluate(model, x, y)
    assert after < 0.6 * before
    assert acc_after > acc_before + 0.3
    model.train()
    test_loss, test_acc = task.evaluate(model)  # the held-out split
    assert model.training, "evaluate restores the training mode"
    assert 0.5 < test_acc <= 1.0 and test_loss > 0


def test_evaluate_rejects_bad_input() -> None:
    task = get_task("digits")
    model = task.build_model()
    with pytest.raises(DataError, match="both x and y"):
        task.evaluate(model, x=task.test_x)
    with pytest.raises(DataError, match="3 inputs but 2 labels"):
        task.evaluate(model, task.test_x[:3], task.test_y[:2])
    with pytest.raises(DataError, match="batch_size must be an int >= 1, got 0"):
        task.evaluate(model, batch_size=0)
    with pytest.raises(DataError, match="no samples"):
        task.evaluate(model, task.test_x[:0], task.test_y[:0])


def test_get_task_leaves_the_torch_rng_alone() -> None:
    torch.manual_seed(9)
    expected = build_model("mlp", (64,), 10).state_dict()
    torch.manual_seed(9)
    task = get_task("digits")
    got = task.build_model().state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_sgd_steps_on_shakespeare_reduce_the_loss() -> None:
    torch.manual_seed(0)
    task = get_task(
        "shakespeare", max_samples_per_client=8, seq_len=20, model_options={"hidden": 32}
    )
    model = task.build_model()
    assert model.lstm.hidden_size == 32
    x, y = task.train_x[:256], task.train_y[:256]
    before, _ = task.evaluate(model, x, y)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(15):
        batch = slice((step % 4) * 64, (step % 4 + 1) * 64)
        opt.zero_grad()
        task.loss_fn(model(x[batch]), y[batch]).backward()
        opt.step()
    after, _ = task.evaluate(model, x, y)
    assert after < before - 0.8
