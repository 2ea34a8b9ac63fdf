"""The settings engine: declare a key once (``setting``), and parse, check, list and flatten it.

A schema is a frozen dataclass whose fields carry their external key (``dgc.density``), a
docstring and an accepted range (a :class:`dgc.config.Check`) in field metadata, so that parsing,
validation, error messages, ``python -m simulations keys`` and the documentation table all come
from one place. Values are validated once, when a schema object is built; every bad value is a
:class:`SettingsError` that names the key and the accepted range.

A key that a compression method may give its own default (``server_momentum``: 0.5 for DGC, 0
for dense FedAvg) is declared with ``fallback``: its field holds None until the run's method
fills it (:mod:`fedgc.settings`), and its external form "" means "the method's default".

This module knows no key of fedgc: each owner declares its keys with it (:mod:`fedgc.keys`: the
run, client, server, engine and attack keys; each compression method its own,
:attr:`fedgc.methods.Method.settings`; the network emulator its ``netem.*`` keys,
``simulations.netem.settings``), and :mod:`fedgc.settings` combines them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import os
import stat
import sys
import tomllib
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, Union, get_args, get_origin, get_type_hints

from dgc.config import Check

__all__ = ["MAX_CONFIG_BYTES", "OPTION_KEYS", "Check", "KeyInfo", "SettingsError", "coerce",
           "describe", "fallback_of", "fields_of", "fill_fallbacks", "flatten", "fold_options",
           "is_sent", "key_table", "known_keys", "load_toml", "options_of", "options_text",
           "parse", "part_of", "per_method_keys", "setting", "to_flat", "validate"]

T = TypeVar("T")

#: Keys whose value is a JSON object of keyword options; a TOML table or a dict is accepted too.
OPTION_KEYS = ("model_options", "task_options")

_NO_FALLBACK = object()


class SettingsError(ValueError):
    """A configuration key is unknown, or its value is outside the accepted range."""


def setting(default: Any, key: str, doc: str, check: Check | None = None, *,
            fallback: Any = _NO_FALLBACK, sent: bool = True) -> Any:
    """A dataclass field with its external key, documentation and accepted range.

    A schema class names the part that owns its keys in a ``PART`` class attribute (the class
    that declares the field: owners compose by inheritance); a dotted key's prefix (``dgc.``,
    ``sim.``, ``netem.``) names it instead. With ``fallback`` the key is one a method may set
    its own default for: declare it ``None`` (the field's type ``float | None``), and
    ``fallback`` is the default of the methods that set none. ``sent=False`` marks a method's
    key that only its server half reads: it stays out of the train messages.
    """
    metadata = {"key": key, "doc": doc, "check": check or Check(), "sent": sent}
    if fallback is not _NO_FALLBACK:
        if default is not None:
            raise TypeError(f"key {key!r}: a per-method key's field default must be None")
        metadata["fallback"] = fallback
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The type hints of a schema class, resolved once per class (resolving the string
    annotations is most of what parsing a message's keys costs)."""
    return get_type_hints(cls)


def fields_of(cls: type) -> list[dataclasses.Field]:
    """The schema fields of a settings class (those declared with :func:`setting`)."""
    return [f for f in dataclasses.fields(cls) if "key" in f.metadata]


def fallback_of(f: dataclasses.Field) -> Any:
    """The default of a per-method key for methods that set none (:func:`setting`)."""
    return f.metadata["fallback"]


def is_sent(f: dataclasses.Field) -> bool:
    """Whether a method's key travels to clients (:func:`setting`'s ``sent``)."""
    return bool(f.metadata.get("sent", True))


def fill_fallbacks(obj: T, defaults: Mapping[str, Any]) -> tuple[T, frozenset[str]]:
    """``obj`` with its per-method keys that are still None set to ``defaults`` (a method's
    :attr:`~fedgc.methods.Method.defaults`; the key's ``fallback`` where it has none), checked,
    and the keys it filled. ``obj`` itself when none is None."""
    filled, named = {}, []
    for f in fields_of(type(obj)):
        if "fallback" in f.metadata and getattr(obj, f.name) is None:
            key = f.metadata["key"]
            filled[f.name] = defaults.get(key, fallback_of(f))
            named.append(key)
    if not filled:
        return obj, frozenset()
    out = dataclasses.replace(obj, **filled)  # type: ignore[type-var]
    validate(out)  # a method's own default must be in range too
    return out, frozenset(named)


def per_method_keys(cls: type) -> list[str]:
    """The keys of ``cls`` that a method may give its own default."""
    return [f.metadata["key"] for f in fields_of(cls) if "fallback" in f.metadata]


def _kind(hint: Any) -> tuple[type, bool]:
    """(the value type, whether None is allowed) of a field's type hint."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def coerce(key: str, value: object, kind: Any) -> Any:
    """Convert ``value`` (typed, or a ``--set`` string) to ``kind``, naming ``key`` on error.

    ``kind`` may be ``X | None`` (a per-method key): None and "" are then None.
    """
    kind, optional = _kind(kind)
    if optional and (value is None or value == ""):
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise SettingsError(f"{key} must be a boolean (true/false), got {value!r}")
    if kind is int or kind is float:
        noun = "an integer" if kind is int else "a number"
        if isinstance(value, bool):
            raise SettingsError(f"{key} must be {noun}, got {value!r}")
        if kind is int and isinstance(value, int):
            return value
        if kind is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if kind is float and isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return kind(value.strip())
            except ValueError:
                pass
        raise SettingsError(f"{key} must be {noun}, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise SettingsError(f"{key} must be a string, got {value!r}")
    raise SettingsError(f"{key}: unsupported setting type {kind!r}")


def unknown_keys(unknown: Iterable[str], known: Iterable[str]) -> SettingsError:
    """The error for keys no setting has: each named with the closest known key, if one is
    close (a misspelling), rather than a list of every key."""
    known = sorted(known)
    named = []
    for key in unknown:
        # A key given without its prefix (``density``) has several owners: name them all.
        close = ([k for k in known if k.rsplit(".", 1)[-1] == key]
                 or difflib.get_close_matches(key, known, n=1, cutoff=0.6))
        hint = " or ".join(repr(k) for k in close)
        named.append(f"{key!r} (did you mean {hint}?)" if close else repr(key))
    return SettingsError(f"unknown configuration key{'s' if len(named) > 1 else ''} "
                         f"{', '.join(named)}; `python -m simulations keys` lists every key")


def parse(cls: type[T], values: Mapping[str, object], *, strict: bool = True) -> T:
    """Build ``cls`` from external keys; with ``strict`` an unknown key is an error."""
    hints = _hints(cls)
    by_key = {f.metadata["key"]: f for f in fields_of(cls)}
    if strict:
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise unknown_keys(unknown, by_key)
    kwargs: dict[str, Any] = {}
    for key, f in by_key.items():
        if key in values:
            value = values[key]
            if key in OPTION_KEYS and isinstance(value, Mapping):
                value = options_text(key, value)
            kwargs[f.name] = coerce(key, value, hints[f.name])
    return cls(**kwargs)


def options_text(key: str, options: Mapping[str, object]) -> str:
    """The JSON text of an options table (what the run config carries), naming ``key`` when a
    value is not JSON (numbers, strings, booleans, lists and tables are)."""
    try:
        return json.dumps(dict(options), sort_keys=True)
    except RecursionError:
        raise SettingsError(f"{key} is nested too deeply for a table of keyword options "
                            f"(Python's recursion limit, {sys.getrecursionlimit()} levels); "
                            f"expected options such as {{'hidden': 64}}") from None
    except (TypeError, ValueError) as ex:
        raise SettingsError(f"{key} must hold JSON values (numbers, strings, booleans, lists, "
                            f"tables), got {dict(options)!r}: {ex}") from None


def fold_options(values: Mapping[str, object]) -> dict[str, object]:
    """``{"task_options.n": 3}`` -> ``{"task_options": {"n": 3}}``, merged into the key's own
    value (a dict, or JSON text) when it is given too."""
    out = {k: v for k, v in values.items() if not any(k.startswith(o + ".") for o in OPTION_KEYS)}
    for key in OPTION_KEYS:
        dotted = {k[len(key) + 1:]: v for k, v in values.items() if k.startswith(key + ".")}
        if not dotted:
            continue
        base = values.get(key, "")
        merged = dict(base) if isinstance(base, Mapping) else options_of(key, str(base))
        out[key] = {**merged, **dotted}
    return out


def options_of(key: str, text: str) -> dict[str, Any]:
    """The keyword options of an options key: ``""`` is none, else a JSON object."""
    if not text.strip():
        return {}
    try:
        options = json.loads(text)
    except RecursionError:
        raise SettingsError(f"{key} is nested too deeply for a JSON object of keyword options "
                            f"(Python's recursion limit, {sys.getrecursionlimit()} levels); "
                            f"expected an object such as '{{\"hidden\": 64}}'") from None
    except json.JSONDecodeError as ex:
        raise SettingsError(f"{key} = {text!r} is not JSON ({ex.msg}); expected an object "
                            f"such as '{{\"hidden\": 64}}'") from None
    if not isinstance(options, dict):
        raise SettingsError(f"{key} = {text!r} must be a JSON object of keyword options, such "
                            f"as '{{\"hidden\": 64}}'")
    bad = [k for k in options if not k.isidentifier()]
    if bad:
        raise SettingsError(f"{key} = {text!r}: option names {bad} are not Python identifiers")
    return options


def validate(obj: object) -> None:
    """Check every schema field of ``obj`` against its accepted range (a per-method key that
    is still None, the method's default to come, is not checked)."""
    hints = _hints(type(obj))
    for f in fields_of(type(obj)):
        key, check = f.metadata["key"], f.metadata["check"]
        value = getattr(obj, f.name)
        kind, optional = _kind(hints[f.name])
        if optional and value is None:
            continue
        if kind in (int, float) and (isinstance(value, bool) or
                                     not isinstance(value, (int, float))):
            raise SettingsError(f"{key} must be a number, got {value!r}")
        if kind is int and not isinstance(value, int):
            raise SettingsError(f"{key} must be an integer, got {value!r}")
        if not check.accepts(value):
            raise SettingsError(f"{key} = {value!r} is outside the accepted range "
                                f"{check.describe()}")


def to_flat(obj: object) -> dict[str, bool | int | float | str]:
    """External-key form of a settings object (what travels in a Flower ConfigRecord); a
    per-method key still None is "" (the method's default)."""
    out = {}
    for f in fields_of(type(obj)):
        value = getattr(obj, f.name)
        out[f.metadata["key"]] = "" if value is None else value
    return out


def _declaring_class(cls: type, key: str) -> type:
    """The class of ``cls``'s bases (or itself) that declares the field of ``key``."""
    name = next(f.name for f in fields_of(cls) if f.metadata["key"] == key)
    return next((c for c in cls.__mro__ if name in inspect.get_annotations(c)), cls)


def part_of(cls: type, key: str, parts: Sequence[str]) -> str:
    """The part of fedgc that owns ``key`` of schema ``cls`` (one of ``parts``)."""
    prefix, dot, _ = key.partition(".")
    part = prefix if dot else getattr(_declaring_class(cls, key), "PART", "")
    if part not in parts:
        raise SettingsError(f"key {key!r} of {cls.__name__} names no part of {list(parts)}")
    return part


class KeyInfo(NamedTuple):
    """One key as ``python -m simulations keys`` lists it."""

    key: str
    part: str
    kind: str
    default: str
    accepted: str
    doc: str


def key_table(classes: Sequence[type], parts: Sequence[str],
              per_method: Callable[[str, Any], str] | None = None) -> list[KeyInfo]:
    """Every key of the given schema classes with its part, sorted by key (``per_method``
    writes the default of a per-method key, see :func:`describe`). A key that several classes
    share (the sparsifiers' keys, inherited by each method that reads them) is listed once;
    two different declarations of one key are a TypeError."""
    rows: dict[str, KeyInfo] = {}
    declared: dict[str, dataclasses.Field] = {}
    for cls in classes:
        by_key = {f.metadata["key"]: f for f in fields_of(cls)}
        for key, kind, default, accepted, doc in describe(cls, per_method):
            if key in declared and declared[key] is not by_key[key]:
                raise TypeError(f"key {key!r} is declared twice ({cls.__name__} and another "
                                f"class); declare it once and inherit it")
            declared[key] = by_key[key]
            rows[key] = KeyInfo(key, part_of(cls, key, parts), kind, default, accepted, doc)
    return sorted(rows.values())


def describe(cls: type, per_method: Callable[[str, Any], str] | None = None,
             ) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, accepted range, doc) for every key of ``cls``, for docs and --help.

    ``per_method(key, fallback)`` writes the default of a per-method key (the methods that set
    their own); without it, ``fallback`` and "(per method)".
    """
    hints = _hints(cls)
    rows = []
    for f in fields_of(cls):
        kind, _ = _kind(hints[f.name])
        accepted = f.metadata["check"].describe()
        if kind is bool:
            accepted = "true or false"
        elif kind is str and accepted == "any":
            accepted = "text"
        # Empty: a default the doc explains (one that depends on other keys).
        default = "''" if f.default is None else repr(f.default)
        if "fallback" in f.metadata:
            fallback = fallback_of(f)
            default = (per_method(f.metadata["key"], fallback) if per_method is not None
                       else f"{fallback!r} (per method)")
        rows.append((f.metadata["key"], kind.__name__, default, accepted, f.metadata["doc"]))
    return rows


def known_keys(classes: Sequence[type]) -> list[str]:
    """Every external key of the given schema classes, sorted."""
    return sorted(f.metadata["key"] for cls in classes for f in fields_of(cls))


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"dgc": {"density": 0.01}}`` -> ``{"dgc.density": 0.01}`` (TOML tables to keys).

    The tables of :data:`OPTION_KEYS` stay whole: they are one key's keyword options.
    """
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and key not in OPTION_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


#: The largest configuration file read: a scenario takes a few kB; a file that never ends
#: (``/dev/zero``) or a huge one is refused before it fills the memory.
MAX_CONFIG_BYTES = 1 << 20


def load_toml(path: str | Path) -> dict[str, Any]:
    """Flat keys of a TOML scenario file; a missing, malformed, non-regular (a device, a FIFO)
    or oversized (over :data:`MAX_CONFIG_BYTES`) file names itself."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer before it can be refused.
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise SettingsError(f"config file {p} is not a regular file; expected a TOML "
                                    f"file")
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise SettingsError(f"config file {p} is over {MAX_CONFIG_BYTES} bytes; a "
                                f"configuration takes a few kB")
        return flatten(tomllib.loads(data.decode("utf-8")))
    except FileNotFoundError as ex:
        raise SettingsError(f"config file {p} does not exist") from ex
    except tomllib.TOMLDecodeError as ex:
        raise SettingsError(f"config file {p} is not valid TOML: {ex}") from ex
    except RecursionError:
        raise SettingsError(f"config file {p} nests tables or arrays too deeply (Python's "
                            f"recursion limit, {sys.getrecursionlimit()} levels)") from None
