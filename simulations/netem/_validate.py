"""Field validators shared by the emulator's dataclasses: each error names the field and range."""

from __future__ import annotations

import math

from simulations.netem.errors import LinkConfigError


def number(owner: str, field: str, value: object, *, minimum: float | None = None,
           maximum: float | None = None, strict_min: bool = False,
           strict_max: bool = False) -> float:
    """Return ``value`` as a finite float, or raise naming ``owner.field`` and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LinkConfigError(f"{owner}.{field} must be a finite number, got {value!r}")
    v = float(value)
    low_bad = minimum is not None and (v <= minimum if strict_min else v < minimum)
    high_bad = maximum is not None and (v >= maximum if strict_max else v > maximum)
    if low_bad or high_bad:
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        lb = "(" if strict_min or minimum is None else "["
        hb = ")" if strict_max or maximum is None else "]"
        raise LinkConfigError(f"{owner}.{field} must be in {lb}{lo}, {hi}{hb}, got {value!r}")
    return v


def integer(owner: str, field: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` as an int >= ``minimum``, or raise naming ``owner.field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LinkConfigError(f"{owner}.{field} must be an integer >= {minimum}, got {value!r}")
    return int(value)
