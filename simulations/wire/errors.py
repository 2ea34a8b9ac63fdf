"""Exceptions of the wire accounting: a capture, key log or ledger that cannot be read."""

from __future__ import annotations


class WireError(ValueError):
    """A capture, key log or wire ledger that cannot be read: the message names the file, the
    field and what was expected, on one line."""
