"""Build a run's Task from its keys: a shipped dataset by name, or a callable of the user's own.

``task = "mnist5k"`` (one of :data:`fedgc.settings.TASKS`) loads the shipped dataset with
:func:`tasks.get_task`, its ``model``, ``model_options``, ``data_dir`` and ``task_options``;
``task = "my_pkg.my_task:build"`` imports ``my_pkg.my_task`` and calls ``build(**task_options)``,
which must return a :class:`tasks.Task`. Server and clients both call :func:`load_task` with the
same keys (clients get them in every train message), so they agree on the data and the model;
each client imports the module itself, so it must be importable there too (PYTHONPATH, or an
installed package).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedgc.settings import TASK_REF, TASKS, SettingsError, TaskSpec, options_of
from tasks import Task, get_task

__all__ = ["load_task", "resolve_callable"]


def load_task(spec: TaskSpec) -> Task:
    """The Task the keys of ``spec`` describe.

    Raises
    ------
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
    build = resolve_callable(spec.task)
    try:
        task = build(**options)
    except Exception as ex:
        raise SettingsError(f"task = {spec.task!r}: calling it with task_options {options} "
                            f"raised {type(ex).__name__}: {ex}") from ex
    if not isinstance(task, Task):
        raise SettingsError(f"task = {spec.task!r} returned {type(task).__name__} "
                            f"({_short(task)}); expected a tasks.Task")
    return task


def resolve_callable(ref: str) -> Any:
    """The callable ``module:attr`` names (``attr`` may be dotted, e.g. ``Class.build``)."""
    if TASK_REF.fullmatch(ref) is None:
        raise SettingsError(f"task = {ref!r} is neither a shipped task {list(TASKS)} nor "
                            f"'module:callable'")
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as ex:
        if ex.name is not None and module_name.startswith(ex.name):
            raise SettingsError(f"task = {ref!r}: no module named {ex.name!r}; it must be "
                                f"importable here and on every client (add its folder to "
                                f"PYTHONPATH, or install it)") from ex
        raise SettingsError(f"task = {ref!r}: importing {module_name!r} failed: {ex}") from ex
    except Exception as ex:
        raise SettingsError(f"task = {ref!r}: importing {module_name!r} raised "
                            f"{type(ex).__name__}: {ex}") from ex
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SettingsError(f"task = {ref!r}: {module_name!r} has no attribute "
                                f"{attr!r}") from None
    if not callable(obj):
        raise SettingsError(f"task = {ref!r} is a {type(obj).__name__}, not a callable "
                            f"returning a tasks.Task")
    return obj


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
