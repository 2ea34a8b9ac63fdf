"""The registry: every method a run may name, by name or as ``pkg.module:callable``.

Each shipped method's module registers it when imported (``fedgc.methods`` imports every
module of the package), so a new method is one new file; ``compare`` runs them by their
``order``. ``method = "my_pkg.my_method:make"`` imports ``my_pkg.my_method`` and calls
``make()``, which must return a :class:`fedgc.methods.Method`; such a method is loaded once per
process by :func:`load_method` (the one function that imports a method's code, so that a
restriction of what may be imported lands in one place) and then known by its reference like a
registered one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fedgc.methods.base import Method
from fedgc.refs import check_allowed, is_ref, resolve_callable, short
from fedgc.schema import SettingsError

__all__ = ["baseline", "compared", "get", "is_known", "load_method", "loaded", "names", "register",
           "registered", "upgrade_run_config"]

_REGISTERED: dict[str, Method] = {}
_LOADED: dict[str, Method] = {}  # module:callable -> the method it returned


def register(method: Method) -> Method:
    """Add ``method`` under its ``name`` (a plain identifier, not taken); returns it."""
    if not isinstance(method, Method):
        raise TypeError(f"register takes a fedgc.methods.Method, got {type(method).__name__}")
    if not method.name.isidentifier() or method.name in _REGISTERED or method.name == "all":
        raise ValueError(f"method name {method.name!r} is not an identifier or is taken "
                         f"('all' stands for every method in compare --methods)")
    _REGISTERED[method.name] = method
    return method


def registered() -> tuple[Method, ...]:
    """The registered methods, in the order ``compare`` runs them (by ``order``, then name)."""
    return tuple(sorted(_REGISTERED.values(), key=lambda m: (m.order, m.name)))


def names() -> tuple[str, ...]:
    """The registered methods' names, in the order ``compare`` runs them."""
    return tuple(m.name for m in registered())


def compared() -> tuple[str, ...]:
    """The methods ``compare`` runs when none are named (``Method.compared``), in order."""
    return tuple(m.name for m in registered() if m.compared)


def loaded() -> tuple[Method, ...]:
    """The registered methods and those loaded by reference so far."""
    return (*registered(), *_LOADED.values())


def baseline() -> str:
    """The method every ratio of a comparison is taken against: the first ``baseline`` one."""
    return next(m.name for m in registered() if m.baseline)


def is_known(value: object) -> bool:
    """Whether ``value`` is a registered name or has the form ``module:callable``."""
    return value in _REGISTERED or is_ref(value)


def get(method: str, allowed: Collection[str] | None = None) -> Method:
    """The method a ``method`` key names: a registered name, or ``module:callable``
    (:func:`load_method`, only if ``allowed``, None: any, holds it); SettingsError naming the
    registered ones otherwise."""
    found = _REGISTERED.get(method)
    if found is not None:
        return found
    if is_ref(method):
        return load_method(method, allowed)
    raise SettingsError(f"method = {method!r} is not a registered method {list(_REGISTERED)} "
                        f"nor 'module:callable'")


def load_method(ref: str, allowed: Collection[str] | None = None) -> Method:
    """The Method that the callable ``ref`` (``pkg.module:callable``) returns, called once per
    process and kept; CallableNotAllowedError when ``allowed`` (None: any) lacks ``ref``, even
    when it is loaded already (a client's node refuses what the server's process loaded);
    SettingsError naming ``method = ref`` when the module cannot be imported, the attribute is
    missing or not callable, the call raises, or it returns something else."""
    check_allowed(ref, "method", allowed)
    if ref in _LOADED:
        return _LOADED[ref]
    make: Any = resolve_callable(ref, "method", "a fedgc.methods.Method", allowed=allowed)
    try:
        method = make()
    except Exception as ex:
        raise SettingsError(f"method = {ref!r}: calling it raised {type(ex).__name__}: "
                            f"{ex}") from ex
    if not isinstance(method, Method):
        raise SettingsError(f"method = {ref!r} returned {type(method).__name__} "
                            f"({short(method)}); expected a fedgc.methods.Method")
    if method.name in _REGISTERED:
        raise SettingsError(f"method = {ref!r} returned a method named {method.name!r}, the "
                            f"name of a registered one; give it a name of its own")
    _LOADED[ref] = method
    return method


#: Before issue 29 some keys had a copy per method family; for the shipped methods of then, the
#: retired key each read (or the value it forced) for what is now one key.
_RETIRED_SOURCES: dict[str, dict[str, str | tuple[str]]] = {
    "dense": {"density": "dgc.density"},
    "fedavgm": {"density": "dgc.density", "server_lr": "dgc.server_lr",
                "server_momentum": "dgc.server_momentum"},
    "topk": {"density": "dgc.density"},
    "stc": {"density": "stc.density", "downlink_density": "stc.downlink_density",
            "downlink_values": ("ternary",)},
    "dgc": {"density": "dgc.density", "server_lr": "dgc.server_lr",
            "server_momentum": "dgc.server_momentum"},
}
_RETIRED = ("dgc.density", "stc.density", "dgc.server_lr", "dgc.server_momentum",
            "stc.downlink_density")


def upgrade_run_config(flat: dict[str, Any]) -> dict[str, Any]:
    """A run config written before issue 29 (a checkpoint's) in today's keys: each one key
    takes the value its method read from the retired keys, which are dropped."""
    if not any(k in flat for k in _RETIRED):
        return flat
    out = dict(flat)
    for new, source in _RETIRED_SOURCES.get(str(flat.get("method")), {}).items():
        if isinstance(source, tuple):
            out[new] = source[0]
        elif source in flat:
            out[new] = flat[source]
    for key in _RETIRED:
        out.pop(key, None)
    return out
