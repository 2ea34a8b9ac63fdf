"""A callable of the user's own, named ``pkg.module:callable``: how a run key names code to import.

``task = "my_pkg.my_task:build"`` (:mod:`fedgc.task_loader`) and ``method =
"my_pkg.my_method:make"`` (:mod:`fedgc.methods.registry`) both resolve their reference here, so
an import that fails, a missing attribute or an object that is not callable is reported the same
way, naming the key, before round 1.

Importing a module and calling a callable runs code: :func:`resolve_callable`, the one function
that turns a reference into code, takes the set of references its caller allows and refuses
another before importing anything. A client passes what its node allows (``client.app``: node
config ``allowed-callables``, :func:`parse_allowed`), so a train message cannot make it run a
callable it was not given; the server passes None, its own run config being trusted
(docs/threat_model.md). Each allowed callable is bound to the run key it may be named by
(``task=pkg.mod:build``): a node that lets a run call ``evil_mod:make`` as its task does not let
it call the same callable as the method factory (issue 35), whose result runs on other paths.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Collection
from typing import Any

from fedgc.schema import SettingsError

__all__ = ["ALLOWED_CALLABLES", "CALLABLE_KEYS", "REF", "CallableNotAllowedError",
           "check_allowed", "is_ref", "parse_allowed", "resolve_callable", "short"]

#: Node config key of the ``key=module:callable`` references a client's node lets a run call,
#: comma-separated; ``*`` lets it call any (simulated nodes: the run config is the simulating
#: user's own).
ALLOWED_CALLABLES = "allowed-callables"
#: The run keys that may name a callable of the user's own.
CALLABLE_KEYS = ("task", "method")


class CallableNotAllowedError(SettingsError):
    """A run names a ``module:callable`` that the caller (a client's node) does not allow."""

#: ``pkg.module:callable`` (the callable may be ``Class.method``).
REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_ref(value: object) -> bool:
    """Whether ``value`` has the form ``pkg.module:callable``."""
    return isinstance(value, str) and REF.fullmatch(value) is not None


def parse_allowed(text: str) -> frozenset[str] | None:
    """A node's ``allowed-callables``: the ``key=module:callable`` entries it lists
    (comma-separated, each key one of :data:`CALLABLE_KEYS`), None for ``*`` (any).

    Raises
    ------
    CallableNotAllowedError
        An entry that is not ``key=module:callable`` (a bare reference binds no key), naming it.
    """
    entries = frozenset(e.strip() for e in str(text).split(",") if e.strip())
    if "*" in entries:
        return None
    for entry in sorted(entries):
        key, sep, ref = entry.partition("=")
        if not sep or key.strip() not in CALLABLE_KEYS or not is_ref(ref.strip()):
            raise CallableNotAllowedError(
                f"{ALLOWED_CALLABLES} entry {short(entry)} is not 'key=module:callable' with a "
                f"key of {list(CALLABLE_KEYS)}: a callable is allowed for the run key it is "
                f"listed under only (e.g. 'task=own_task.task:build')")
    return frozenset(f"{k.strip()}={r.strip()}" for k, _, r in
                     (e.partition("=") for e in entries))


def check_allowed(ref: str, key: str, allowed: Collection[str] | None) -> None:
    """Refuse ``ref`` (the value of run key ``key``) unless ``allowed`` (None: any) holds it
    for that key (``key=ref``, :func:`parse_allowed`).

    Raises
    ------
    CallableNotAllowedError
        ``allowed`` is a collection without ``key=ref``.
    """
    if allowed is not None and f"{key}={ref}" not in allowed:
        listed = ", ".join(sorted(allowed)[:5]) or "none"
        raise CallableNotAllowedError(
            f"{key} = {ref!r} is not allowed on this node: a client runs only the callables its "
            f"node config lists in {ALLOWED_CALLABLES!r}, each for its key (it lists: "
            f"{listed}), whatever the server sends; add '{key}={ref}' there on the node to "
            f"trust it (docs/threat_model.md)")


def resolve_callable(ref: str, key: str = "task", returns: str = "a tasks.Task", *,
                     allowed: Collection[str] | None = None) -> Any:
    """The callable ``module:attr`` names (``attr`` may be dotted, e.g. ``Class.build``).

    ``key`` is the run key that named it and ``returns`` what the callable must return, for
    the messages. ``allowed``: the references the caller may run (None: any); another is refused
    before its module is imported, since importing runs the module's code.

    Raises
    ------
    CallableNotAllowedError
        ``ref`` is not in ``allowed``.
    SettingsError
        ``ref`` is not ``module:callable``, its module cannot be imported, lacks the attribute,
        or holds something that is not callable.
    """
    if not is_ref(ref):
        raise SettingsError(f"{key} = {ref!r} is not 'module:callable'")
    check_allowed(ref, key, allowed)
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as ex:
        if ex.name is not None and module_name.startswith(ex.name):
            raise SettingsError(f"{key} = {ref!r}: no module named {ex.name!r}; it must be "
                                f"importable here and on every client (add its folder to "
                                f"PYTHONPATH, or install it)") from ex
        raise SettingsError(f"{key} = {ref!r}: importing {module_name!r} failed: {ex}") from ex
    except Exception as ex:
        raise SettingsError(f"{key} = {ref!r}: importing {module_name!r} raised "
                            f"{type(ex).__name__}: {ex}") from ex
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SettingsError(f"{key} = {ref!r}: {module_name!r} has no attribute "
                                f"{attr!r}") from None
    if not callable(obj):
        raise SettingsError(f"{key} = {ref!r} is a {type(obj).__name__}, not a callable "
                            f"returning {returns}")
    return obj


def short(value: object) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
