"""Privacy for compressed updates: secure aggregation, the methods it applies to, and
differential privacy.

- :mod:`fedgc.privacy.fixed_point`: float vectors as integers modulo 2^b and their sum back.
- :mod:`fedgc.privacy.secagg`: SecAgg+ as a server session and a client handler.
- :mod:`fedgc.privacy.linear`: which methods' payloads sum at coordinates every client knows,
  and the vector each payload becomes.
- :mod:`fedgc.privacy.dp`: client-level DP-FedAvg (clipping, adaptive clipping, central or
  distributed noise) and the privacy spent, from ``dp-accounting``.

``docs/privacy.md`` says what is built and where the guarantees stop; ``docs/threat_model.md``
who learns what.
"""

from fedgc.privacy.fixed_point import FixedPoint, FixedPointError, SumOutOfRange

__all__ = ["FixedPoint", "FixedPointError", "SumOutOfRange"]
