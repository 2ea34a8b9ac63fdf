"""Build a run's Task from its keys: a shipped dataset by name, or a callable of the user's own.

``task = "mnist5k"`` (one of :data:`fedgc.settings.TASKS`) loads the shipped dataset with
:func:`tasks.get_task`, its ``model``, ``model_options``, ``data_dir`` and ``task_options``;
``task = "my_pkg.my_task:build"`` imports ``my_pkg.my_task`` and calls ``build(**task_options)``,
which must return a :class:`tasks.Task`. Server and clients both call :func:`load_task` with the
same keys (clients get them in every train message), so they agree on the data and the model;
each client imports the module itself, so it must be importable there too (PYTHONPATH, or an
installed package).

Importing a module and calling a callable runs code: :func:`resolve_callable`, the one function
that turns a ``module:callable`` reference (a task's, a method's) into code, takes the set of
references its caller allows. A client passes what its node allows (``client.app``: node config
``allowed-callables``), so a train message cannot make it run a callable it was not given; the
server passes None, its own run config being trusted (docs/threat_model.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

from fedgc.settings import TASK_REF, TASKS, SettingsError, TaskSpec, options_of
from tasks import Task, get_task

#: Node config key of the ``module:callable`` references a client's node lets a run call,
#: comma-separated; ``*`` lets it call any (simulated nodes: the run config is the simulating
#: user's own).
ALLOWED_CALLABLES = "allowed-callables"

__all__ = ["ALLOWED_CALLABLES", "CallableNotAllowedError", "load_task", "resolve_callable"]


class CallableNotAllowedError(SettingsError):
    """A run names a ``module:callable`` that the caller (a client's node) does not allow."""


def load_task(spec: TaskSpec, allowed: Collection[str] | None = None) -> Task:
    """The Task the keys of ``spec`` describe; a ``module:callable`` only if ``allowed`` (None:
    any) holds it.

    Raises
    ------
    CallableNotAllowedError
        ``spec.task`` is a ``module:callable`` that ``allowed`` does not hold (nothing imported).
    SettingsError
        A ``module:callable`` whose module or attribute is missing, that raises, or that
        returns something other than a Task; options that are not a JSON object.
    tasks.DataError
        A shipped task's data files are missing or malformed, or its model options do not fit.
    """
    options = options_of("task_options", spec.task_options)
    if spec.task in TASKS:
        return get_task(spec.task, model=spec.model or None, data_dir=spec.data_dir or None,
                        model_options=options_of("model_options", spec.model_options) or None,
                        **options)
    build = resolve_callable(spec.task, allowed=allowed)
    try:
        task = build(**options)
    except Exception as ex:
        raise SettingsError(f"task = {spec.task!r}: calling it with task_options {options} "
                            f"raised {type(ex).__name__}: {ex}") from ex
    if not isinstance(task, Task):
        raise SettingsError(f"task = {spec.task!r} returned {type(task).__name__} "
                            f"({_short(task)}); expected a tasks.Task")
    return task


def resolve_callable(ref: str, allowed: Collection[str] | None = None,
                     key: str = "task") -> Any:
    """The callable ``module:attr`` names (``attr`` may be dotted, e.g. ``Class.build``).

    ``allowed``: the references the caller may run (None: any); another is refused before
    its module is imported, since importing runs the module's code. ``key`` names the run key
    in messages (``task``, ``method``).

    Raises
    ------
    CallableNotAllowedError
        ``ref`` is not in ``allowed``.
    SettingsError
        ``ref`` is not ``module:callable``, its module or attribute is missing, or it is not a
        callable.
    """
    if TASK_REF.fullmatch(ref) is None:
        raise SettingsError(f"{key} = {ref!r} is neither a shipped {key} nor "
                            f"'module:callable'" + (f" (shipped: {list(TASKS)})"
                                                    if key == "task" else ""))
    if allowed is not None and ref not in allowed:
        listed = ", ".join(sorted(allowed)[:5]) or "none"
        raise CallableNotAllowedError(
            f"{key} = {ref!r} is not allowed on this node: a client runs only the callables its "
            f"node config lists in {ALLOWED_CALLABLES!r} (it lists: {listed}), whatever the "
            f"server sends; add it there on the node to trust it (docs/threat_model.md)")
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
        raise SettingsError(f"{key} = {ref!r} is a {type(obj).__name__}, not a callable"
                            + (" returning a tasks.Task" if key == "task" else ""))
    return obj


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
