"""Tests of the Shakespeare parser and the next-character task built on it."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import DataError, get_task
from tasks.shakespeare import POEMS, load_roles, parse_play, speaker_name, vocabulary

PLAY = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Ham., a prince.
Players.

ACT I.

Scene I. A platform.

[Enter Hamlet and Horatio.]

Ham.
To be, or not to be,
that is the question.

Hor. [Aside.]
My lord?

[Exit Horatio.]

Whether 'tis nobler. [Sits.] In the mind.

FIRST CLOWN.

Here lies the water.

[Enter many, with
a very long train]

SCENE II. Elsewhere.

A line nobody speaks.

PROLOGUE
'If we offend, it is with our good will.

EPILOGUE

Ham.
The rest is silence.
"""


@pytest.fixture(autouse=True)
def _one_thread():
    # The test machines are shared; one intra-op thread is faster than contended threads here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_speaker_lines() -> None:
    assert speaker_name("Ham.") == "Ham"
    assert speaker_name("First Clown.") == "First Clown"
    assert speaker_name("BOATSWAIN") == "BOATSWAIN"
    assert speaker_name("Duke of York.") == "Duke of York"
    assert speaker_name("To be, or not to be,") is None
    assert speaker_name("Go seek him there.") is None
    assert speaker_name("Farewell") is None  # no period: must be upper case to count


def test_parse_play_rules() -> None:
    roles = parse_play(PLAY)
    assert set(roles) == {"Ham", "Hor", "FIRST CLOWN", "PROLOGUE"}
    # Speech resumes after a stage direction; inline directions vanish; lines join with spaces.
    assert roles["Hor"] == "My lord? Whether 'tis nobler. In the mind."
    assert roles["Ham"] == "To be, or not to be, that is the question. The rest is silence."
    assert roles["FIRST CLOWN"] == "Here lies the water."
    assert roles["PROLOGUE"] == "'If we offend, it is with our good will."
    text = " ".join(roles.values())
    assert "[" not in text and "Enter" not in text and "nobody speaks" not in text
    assert "prince" not in text, "the list of persons before ACT I is skipped"


def test_unclosed_and_stray_brackets() -> None:
    play = (
        "ACT I.\n\nKING.\nUncles, hear me. [Going.\nStay, I say.\n\n"
        "[Enter MENENIUS\nand others\n\nKING.\nAnd more.\n\n"
        "[A sennet. Enter the Consul,\n\ntake their places.]\n\nStill the king.\n"
    )
    assert parse_play(play) == {"KING": "Uncles, hear me. Stay, I say. And more. Still the king."}


def test_shipped_plays_parse_like_datasets_md() -> None:
    roles = load_roles()
    plays = {r.play for r in roles}
    assert len(plays) == 37
    assert not any(p.startswith(POEMS) for p in plays), "poems are left out"
    assert 1250 <= len(roles) <= 1450
    lengths = np.array([len(r.text) for r in roles])
    assert 580 <= (lengths >= 1000).sum() <= 680
    assert 230 <= (lengths >= 5000).sum() <= 290
    assert 3.9e6 <= lengths.sum() <= 4.5e6
    text = "".join(r.text for r in roles)
    for junk in ("[", "]", "{", "Exeunt.", "Enter ", "ACT ", "SCENE "):
        assert text.count(junk) <= 5, junk
    assert 70 <= len(vocabulary(roles)) <= 90
    hamlet = {r.name: r.text for r in roles if r.play == "hamlet"}
    assert hamlet["Ham"].count("To be, or not to be") == 1 and len(hamlet["Ham"]) > 50_000
    assert load_roles() is roles, "the parse is cached"


def test_default_task() -> None:
    task = get_task("shakespeare", seed=0)
    assert task.model_name == "lstm" and task.input_shape == (80,)
    vocab = task.info["vocabulary"]
    assert task.num_classes == len(vocab)
    assert task.train_x.dtype == torch.int64 and task.train_y.dtype == torch.int64
    clients = task.natural_clients
    assert len(clients) == len(task.info["client_ids"]) == 635
    assert max(len(c) for c in clients) == 200
    joined = np.concatenate(clients)
    assert np.array_equal(joined, np.arange(len(task.train_y))), "roles tile the training set"
    assert len(task.test_y) == 10_000
    # Every sample is 80 consecutive characters of one role followed by the next one.
    sample = "".join(vocab[i] for i in task.train_x[1234].tolist())
    target = vocab[int(task.train_y[1234])]
    role = task.info["client_ids"][next(i for i, c in enumerate(clients) if 1234 in c)]
    play, name = role.split("/", 1)
    text = next(r.text for r in load_roles() if r.play == play and r.name == name)
    assert sample + target in text
    parts = task.partition(scheme="natural")
    assert len(parts) == 635 and all(
        np.array_equal(a, b) for a, b in zip(parts, clients, strict=True)
    )
    some = task.partition(10, scheme="natural", seed=3)
    assert len(some) == 10 and np.unique(np.concatenate(some)).size == sum(len(p) for p in some)
    with pytest.raises(DataError, match="num_clients=636 but dataset 'shakespeare' has 635"):
        task.partition(636, scheme="natural")
    model = task.build_model()
    assert model(task.test_x[:3]).shape == (3, task.num_classes)


def test_options_change_the_split() -> None:
    small = get_task("shakespeare", min_chars=20_000, stride=40, max_samples_per_client=None)
    assert 30 <= len(small.natural_clients) <= 80
    # Uncapped stride-40 windows over the first 80% of each role: one per 40 characters.
    for chars, client in zip(small.info["chars_per_client"], small.natural_clients, strict=True):
        assert chars >= 20_000
        assert len(client) == -(-(round(0.8 * chars) - 80) // 40)
    first = small.natural_clients[0]
    seq = small.train_x[first]
    assert torch.equal(seq[1, :40], seq[0, 40:]), "stride 40 windows overlap by 40 characters"
    a = get_task("shakespeare", seed=1, max_samples_per_client=20, max_test_samples=500)
    b = get_task("shakespeare", seed=1, max_samples_per_client=20, max_test_samples=500)
    assert torch.equal(a.train_x, b.train_x) and len(a.test_y) == 500


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"seq_len": 0}, "seq_len must be an int >= 1, got 0"),
        ({"stride": 1.5}, "stride must be an int >= 1, got 1.5"),
        ({"test_fraction": 1.0}, r"test_fraction must be in \(0, 1\), got 1.0"),
        ({"max_samples_per_client": 0}, "max_samples_per_client must be an int >= 1 or None"),
        ({"min_chars": 10**9}, "no Shakespeare role qualifies with min_chars=1000000000"),
        ({"epochs": 3}, r"unknown option\(s\) \['epochs'\] for dataset 'shakespeare'"),
    ],
)
def test_bad_options(options: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        get_task("shakespeare", **options)


def test_texts_from_a_folder(tmp_path: Path) -> None:
    (tmp_path / "testing_gut.txt").write_bytes(
        PLAY.replace("question", "qu\xe9stion").encode("latin-1")
    )
    (tmp_path / "sonnets_gut.txt").write_text("ACT I.\n\nPOET.\nShall I compare thee\n")
    (tmp_path / "testing_gut_f.txt").write_text("ACT I.\n\nFOLIO.\nIgnored text\n")
    roles = load_roles(tmp_path)
    assert {r.play for r in roles} == {"testing"}
    assert "qu\xe9stion" in next(r.text for r in roles if r.name == "Ham")
    task = get_task("shakespeare", data_dir=tmp_path, min_chars=40, seq_len=4)
    assert "\xe9" in task.info["vocabulary"]
    with pytest.raises(DataError, match=r"no \*_gut.txt files in folder"):
        get_task("shakespeare", data_dir=tmp_path / "nowhere")


def test_training_loss_covers_every_position() -> None:
    task = get_task("shakespeare", max_samples_per_client=2, max_test_samples=10)
    torch.manual_seed(0)
    model = task.build_model()
    x, y = task.train_x[:3], task.train_y[:3]
    logits = model.sequence_logits(x)
    assert logits.shape == (3, 80, task.num_classes)
    assert torch.allclose(logits[:, -1], model(x), atol=1e-6), "the last step is forward()"
    # Targets are the input shifted by one, then the label: each window's next characters.
    want = torch.stack([torch.nn.functional.cross_entropy(logits[:, t], x[:, t + 1])
                        for t in range(79)] + [torch.nn.functional.cross_entropy(logits[:, -1], y)])
    assert torch.allclose(task.training_loss(model, x, y), want.mean(), atol=1e-5)
    task.sequence_loss = False
    assert torch.allclose(task.training_loss(model, x, y), task.loss_fn(model(x), y))
    mnist = get_task("digits")
    mlp = mnist.build_model()
    assert not mnist.sequence_loss
    assert torch.equal(mnist.training_loss(mlp, mnist.train_x[:5], mnist.train_y[:5]),
                       mnist.loss_fn(mlp(mnist.train_x[:5]), mnist.train_y[:5]))
