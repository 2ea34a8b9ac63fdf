"""Build a run's Task from its keys: a shipped dataset by name, or a callable of the user's own.

``task = "mnist5k"`` (one of :data:`fedgc.keys.run.TASKS`) loads the shipped dataset with
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

from collections.abc import Collection
from typing import Any

from fedgc.keys.run import TASKS, TaskSpec
from fedgc.refs import (
    ALLOWED_CALLABLES,
    CallableNotAllowedError,
    is_ref,
    resolve_callable,
    short,
)
from fedgc.schema import SettingsError, options_of
from tasks import Task, get_task

__all__ = ["ALLOWED_CALLABLES", "CallableNotAllowedError", "load_task", "resolve_callable"]


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
    if not is_ref(spec.task):
        raise SettingsError(f"task = {spec.task!r} is neither a shipped task {list(TASKS)} nor "
                            f"'module:callable'")
    build: Any = resolve_callable(spec.task, "task", "a tasks.Task", allowed=allowed)
    try:
        task = build(**options)
    except Exception as ex:
        raise SettingsError(f"task = {spec.task!r}: calling it with task_options {options} "
                            f"raised {type(ex).__name__}: {ex}") from ex
    if not isinstance(task, Task):
        raise SettingsError(f"task = {spec.task!r} returned {type(task).__name__} "
                            f"({short(task)}); expected a tasks.Task")
    return task
