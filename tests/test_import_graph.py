"""The project's imports: no cycle among its modules, dependencies pointing the way
ARCHITECTURE's layout says, and every import inside a function kept for start-up time.

Every ``import`` statement of the packages below counts: at module level, inside functions and
under ``if TYPE_CHECKING`` (a cycle hidden in a function or a type check still ties the two
modules together). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
to ``pkg`` otherwise.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dgc", "tasks", "fedgc", "client", "server", "android_bridge", "simulations")
#: What each package may import (besides itself). dgc <- client, server, android_bridge <-
#: simulations; tasks and the shared layer fedgc are used by all of them; the phone bridge
#: speaks for phones as a client does (client.app's data and state).
ALLOWED = {
    "dgc": set(),
    "tasks": set(),
    "fedgc": {"dgc", "tasks"},
    "client": {"dgc", "tasks", "fedgc"},
    "server": {"dgc", "tasks", "fedgc"},
    "android_bridge": {"dgc", "tasks", "fedgc", "client"},
    "simulations": {"dgc", "tasks", "fedgc", "client", "server", "android_bridge"},
}
#: Single edges outside ALLOWED, each with why. fedgc's public API (``fedgc.run``) is a lazy
#: attribute over simulations.api: ``import fedgc`` imports no simulations module.
EXCEPTIONS = {
    ("fedgc", "simulations.api"): "fedgc.run/compare/results, resolved on first use",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool  # inside a function


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its ``__init__``'s)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def edges(mods: dict[str, Path]) -> list[Edge]:
    """Every import of one project module by another."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found: list[Edge] = []
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

        def visit(node: ast.AST, local: bool, name: str = name,
                  package: list[str] = package) -> None:
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package[:len(package) - (child.level - 1)]
                        base = ".".join(up + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                               for a in child.names]
                else:
                    targets = []
                for target in {resolve(t) for t in targets} - {None, name}:
                    found.append(Edge(name, str(target), child.lineno, inner))
                visit(child, inner)

        visit(ast.parse(path.read_text()), False)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_and_a_type_check(tmp_path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "one.py").write_text("def f():\n    from pkg.two import g\n")
    (tmp_path / "pkg" / "two.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import one\n")
    mods = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.one": tmp_path / "pkg" / "one.py",
            "pkg.two": tmp_path / "pkg" / "two.py"}
    found = edges(mods)
    assert {(e.source, e.target, e.local) for e in found} == {("pkg.one", "pkg.two", True),
                                                              ("pkg.two", "pkg.one", False)}
    graph = defaultdict(set)
    for e in found:
        graph[e.source].add(e.target)
    assert cycles({m: graph[m] for m in mods}) == [["pkg.one", "pkg.two"]]


def test_no_import_cycles() -> None:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges(mods):
        graph[e.source].add(e.target)
    assert cycles(graph) == []


def test_imports_point_the_way_the_layout_says() -> None:
    wrong, used = [], set()
    for e in edges(modules()):
        src, dst = e.source.split(".")[0], e.target.split(".")[0]
        if src == dst or dst in ALLOWED[src]:
            continue
        if (e.source, e.target) in EXCEPTIONS:
            used.add((e.source, e.target))
            continue
        wrong.append(f"{e.source} (line {e.line}) imports {e.target}")
    assert wrong == []
    # An exception no longer needed goes.
    assert used == set(EXCEPTIONS), sorted(set(EXCEPTIONS) - used)


def test_imports_inside_functions_say_they_buy_start_up_time() -> None:
    """A project module imported inside a function says why in a comment naming start-up: on
    the import's line, or in the comments right above its block of imports (an exception to
    the layout's directions other than fedgc's API answers for itself)."""
    mods = modules()
    silent = []
    for e in edges(mods):
        if not e.local or (e.source, e.target) in EXCEPTIONS and e.source != "fedgc":
            continue
        lines = mods[e.source].read_text().splitlines()
        i, said = e.line - 1, "start-up" in lines[e.line - 1]
        while not said and i > 0:
            i -= 1
            text = lines[i].strip()
            if text.startswith("#"):
                said = "start-up" in text
            elif not (text == "" or text.startswith(("import ", "from ", ")"))
                      or text.endswith(",")):
                break
        if not said:
            silent.append(f"{e.source}:{e.line} imports {e.target}")
    assert sorted(set(silent)) == []


def test_the_reference_phone_imports_without_flower() -> None:
    """The emulated arm64 phone's environment has no Flower (a phone has none): the reference
    phone's module, and what it imports of fedgc, load with ``flwr`` unimportable (a patch's
    application lives in ``fedgc.patching`` for it, not in ``fedgc.protocol``)."""
    import subprocess
    import sys

    code = ("import importlib.abc, sys\n"
            "class NoFlower(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'flwr':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, NoFlower())\n"
            "import android_bridge.phone\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
