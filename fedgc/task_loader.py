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

from typing import Any

from fedgc.refs import is_ref, resolve_callable, short
from fedgc.schema import SettingsError, options_of
from fedgc.settings import TASKS, TaskSpec
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
    if not is_ref(spec.task):
        raise SettingsError(f"task = {spec.task!r} is neither a shipped task {list(TASKS)} nor "
                            f"'module:callable'")
    build: Any = resolve_callable(spec.task, "task", "a tasks.Task")
    try:
        task = build(**options)
    except Exception as ex:
        raise SettingsError(f"task = {spec.task!r}: calling it with task_options {options} "
                            f"raised {type(ex).__name__}: {ex}") from ex
    if not isinstance(task, Task):
        raise SettingsError(f"task = {spec.task!r} returned {type(task).__name__} "
                            f"({short(task)}); expected a tasks.Task")
    return task
