"""DGC is one plugin among others (issue 36): its keys and classes live with its method, the
hooks are typed, the dependencies point one way, and a new method is one file.

What these hold could come back one line at a time (a ``dgc.*`` key read by the server, a hook
typed ``Any``, ``fedgc/methods`` importing ``server``): each is checked on the tree.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

import fedgc.methods.dgc as dgc_method
from fedgc import methods
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods import Codec, Method, PhoneExport, RoundMaterial, SparseCodec
from fedgc.methods.dgc import DGCSettings
from fedgc.schema import Check, SettingsError, fields_of, setting
from fedgc.settings import RunConfig

ROOT = Path(__file__).resolve().parents[1]
#: Where no DGC key or class may appear: the server, the clients, the simulations.
GENERIC = ("server", "client", "simulations")
#: DGC's classes: its method's and its algorithm's compressor, configuration and memory.
DGC_CLASSES = sorted({n for n, o in vars(dgc_method).items()
                      if inspect.isclass(o) and o.__module__ == dgc_method.__name__}
                     | {"DGCCompressor", "DGCConfig", "DGCMemory", "TwoDensityCompressor"})
#: Names with DGC in them that the generic code may use, and why. ``DGCStrategy`` is the
#: server's Flower strategy (ARCHITECTURE.md's public surface), which serves every method;
#: renaming it is a public API change that belongs with the server's extension point (the
#: emulator's strategy subclasses it today), not with the methods.
ALLOWED = {"DGCStrategy"}


def _sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _identifiers(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every name, attribute, import and class the module's code uses."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.ImportFrom):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string, docstring and comment of the module (not its code: a
    module path such as ``dgc.selection`` is the algorithm's library, not a key)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens
            if t.type in (tokenize.STRING, tokenize.COMMENT)]


def test_no_generic_module_mentions_a_dgc_key_or_a_dgc_class():
    """The server, the clients and the simulations know no ``dgc.*`` key (in code, strings,
    docstrings or comments) and no class of DGC's (DGC_CLASSES; any other ``DGC...`` name
    but ALLOWED): DGC's keys, round material and phone export reach them through the Method."""
    keys = sorted(f.metadata["key"] for f in fields_of(DGCSettings))
    assert "dgc.small_density" in keys and "dgc.shared_density" in keys
    key = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w])")
    # In prose "DGC" is the algorithm's name: text is searched for the other class names.
    named = re.compile(r"\b(" + "|".join(c for c in DGC_CLASSES if c != "DGC") + r")\b")
    found = []
    for path in _sources(GENERIC):
        where = path.relative_to(ROOT)
        found += [f"{where}:{n}: key {m.group(1)}" for n, text in _text(path)
                  for m in key.finditer(text)]
        found += [f"{where}:{n}: class {m.group(1)}" for n, text in _text(path)
                  for m in named.finditer(text)]
        found += [f"{where}:{n}: name {name}" for n, name in _identifiers(path)
                  if re.fullmatch(r"DGC\w*", name) and name not in ALLOWED
                  or name in DGC_CLASSES]
    assert found == []


def test_the_scan_would_see_a_key_or_a_class():
    """The scan reads what it must: a key in a string, a class in code or in a comment."""
    sample = ROOT / "fedgc" / "methods" / "dgc.py"
    assert any("dgc.small_density" in text for _, text in _text(sample))
    assert any(name == "TwoDensityCompressor" or name == "DGCConfig"
               for _, name in _identifiers(sample))


def test_methods_import_nothing_of_the_server_or_the_clients():
    """The dependencies point one way: ``fedgc`` is the layer both ends share (but for the
    public API, ``fedgc.run`` and the rest, which ``fedgc/__init__.py`` resolves from
    ``simulations.api`` on first use: tests/test_import_graph.py's one exception)."""
    found = []
    for path in _sources(("fedgc",)):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}: {m}" for m in modules
                      if m.split(".")[0] in ("server", "client", "simulations", "android_bridge")]
    assert found == ["fedgc/__init__.py: simulations"]


def test_the_owners_keys_import_no_method():
    """``fedgc.keys`` (the owners' keys, which the hooks are typed with) imports neither the
    registry nor a method, so that every method may import it."""
    for path in _sources(("fedgc/keys",)):
        tree = ast.parse(path.read_text())
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m and (m.startswith("fedgc.methods")
                                                 or m == "fedgc.settings")], path


def test_settings_is_the_combination_only():
    """``fedgc/settings.py`` combines the owners' keys; it declares none of them."""
    text = (ROOT / "fedgc" / "settings.py").read_text()
    assert len(text.splitlines()) <= 400
    assert " = setting(" not in text


HOOKS = ("compressor", "codec", "uplink_density", "aggregator", "optimizer", "downlink",
         "check", "with_keys", "channel", "read_material", "hold_material", "prepare",
         "side_part", "read_side", "phone_config", "phone_small", "phone_refusals")


def _hook_annotations() -> list[tuple[str, str, str]]:
    """(class, hook, annotation) of every hook the contract and each registered method define."""
    classes = {Method, RoundMaterial, PhoneExport, *(type(m) for m in methods.registered())}
    out = []
    for cls in classes:
        for hook in HOOKS:
            fn = cls.__dict__.get(hook)
            if fn is None:
                continue
            out += [(cls.__name__, hook, str(a)) for a in inspect.get_annotations(fn).values()]
    return out


def test_no_hook_is_typed_any():
    """Every hook takes typed settings (TrainSettings, RunSettings, the method's own) and
    typed material (``object``: what the method's own read_material made)."""
    annotations = _hook_annotations()
    assert len(annotations) > 60
    assert [a for a in annotations if re.search(r"\bAny\b", a[2])] == []
    assert ("Method", "compressor", "TrainSettings") in annotations
    assert ("RoundMaterial", "channel", "RunSettings") in annotations


# ------------------------------------------------------------------ a new method, one file
@dataclass(frozen=True)
class HalfSettings:
    """A test method's own keys: one sent to clients, one only its server reads."""

    share: float = setting(0.5, "half.share", "fraction of each tensor sent", Check(0.0, 1.0))
    log_every: int = setting(1, "half.log_every", "the server's own", Check(1), sent=False)


class HalfCompressor(methods.StatelessCompressor):
    """The first ``share`` of each tensor's entries, nothing kept."""

    def __init__(self, share: float) -> None:
        self.share = share

    def compress(self, grads, epoch=0.0, sequence=None):
        import torch

        from dgc import SparseTensor, SparseUpdate

        out = {}
        for name, g in grads.items():
            idx = torch.arange(int(self.share * g.numel()))
            out[name] = SparseTensor(idx, g.reshape(-1)[idx].float(), tuple(g.shape))
        return SparseUpdate(out, sequence or 0)


class Half(Method[HalfSettings]):
    """A method of its own keys, payload and phone refusal (phones: not served)."""

    name, settings, description = "half", HalfSettings, "the first half of every tensor"

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> HalfCompressor:
        return HalfCompressor(self.own.share)

    def codec(self, train: TrainSettings) -> Codec:
        return SparseCodec()

    def aggregator(self, run: RunSettings) -> methods.Aggregator:
        return methods.Aggregator()


def make() -> Method:
    return Half()


def test_a_new_method_is_one_file_with_its_keys_payload_and_phone_refusal(tmp_path):
    """This file's ``Half``: its keys parse, range-check and travel (the server's one stays
    home), it runs end to end, and phones refuse it by name; no file of fedgc knows it."""
    from android_bridge.export import ConfigError, check_phone_run
    from simulations.cli import main

    ref = "tests.test_method_plugins:make"
    run = RunConfig.from_flat({"method": ref, "half.share": 0.25, "run_name": "h"})
    assert (run.method.own.share, run.method.own.log_every) == (0.25, 1)
    assert run.client_config()["half.share"] == 0.25 and "half.log_every" not in \
        run.client_config() and run.to_flat()["half.log_every"] == 1
    with pytest.raises(SettingsError, match=r"half.share = 2.0 is outside the accepted range"):
        RunConfig.from_flat({"method": ref, "half.share": 2.0})
    with pytest.raises(ConfigError, match=r"'half' is not served by phones.*'dgc'"):
        check_phone_run(run.method, run.server)
    assert main(["run", "--set", "task=digits", "--set", "sim.engine=local", "--set",
                 "num_clients=4", "--set", "clients_per_round=2", "--set", "rounds=2",
                 "--set", "progress=false", "--set", f"method={ref}", "--set", "half.share=0.1",
                 "--set", f"results_dir={tmp_path}", "--set", "run_name=h"]) == 0
    import json

    summary = json.loads((tmp_path / "h" / "summary.json").read_text())
    assert summary["config"]["half.share"] == 0.1 and summary["clients_rejected"] == 0
    assert 5 < summary["uplink_compression"] < 20  # a tenth of each tensor, with its indices


def test_the_own_method_example_stays_short():
    """examples/own_method: a user writes only its compressor's ``compress``, its key and its
    Method (under 60 lines; it re-implemented the residual's bookkeeping before issue 36)."""
    text = (ROOT / "examples" / "own_method" / "method.py").read_text()
    assert len(text.splitlines()) < 60
    assert "ResidualCompressor" in text and "def restore" not in text
