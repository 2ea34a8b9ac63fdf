"""The errors secure aggregation raises on purpose: one base type, one kind per reason."""

from __future__ import annotations

__all__ = ["BadMessage", "SecAggError", "StageError", "ThresholdError"]


class SecAggError(ValueError):
    """Base class of every error of :mod:`fedgc.privacy.secagg`."""


class BadMessage(SecAggError):
    """A message that does not decode, or does not fit the session (wrong lengths, ids, counts,
    a share that fails its commitment, a ciphertext that does not authenticate)."""


class StageError(SecAggError):
    """A message or call out of the protocol's order (a stage repeated, skipped, or after the
    session ended)."""


class ThresholdError(SecAggError):
    """Too few clients are left for the protocol to go on without exposing one: the session
    ends with no sum."""
