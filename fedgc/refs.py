"""A callable of the user's own, named ``pkg.module:callable``: how a run key names code to import.

``task = "my_pkg.my_task:build"`` (:mod:`fedgc.task_loader`) and ``method =
"my_pkg.my_method:make"`` (:mod:`fedgc.methods.registry`) both resolve their reference here, so
an import that fails, a missing attribute or an object that is not callable is reported the same
way, naming the key, before round 1.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from fedgc.schema import SettingsError

__all__ = ["REF", "is_ref", "resolve_callable", "short"]

#: ``pkg.module:callable`` (the callable may be ``Class.method``).
REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_ref(value: object) -> bool:
    """Whether ``value`` has the form ``pkg.module:callable``."""
    return isinstance(value, str) and REF.fullmatch(value) is not None


def resolve_callable(ref: str, key: str, returns: str) -> Any:
    """The callable ``module:attr`` names (``attr`` may be dotted, e.g. ``Class.build``).

    ``key`` is the run key that named it and ``returns`` what the callable must return, for
    the messages. Raises :class:`SettingsError` naming ``key = ref`` when the module cannot be
    imported, lacks the attribute, or holds something that is not callable.
    """
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
