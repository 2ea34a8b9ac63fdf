"""Phone export, an opt-in part of a method: what a phone runs for it, and how the bridge reads it.

Phones run one encoder, exported with ExecuTorch (``android_bridge.export``): DGC's top-k with
or without its residual and momentum correction, configured by a :class:`dgc.DGCConfig`, and an
optional second density for small tensors. A method whose clients phones can stand in for
inherits :class:`PhoneExport` beside :class:`fedgc.methods.Method` and says which configuration,
or names a phone-side encoder of its own instead (:meth:`PhoneExport.phone_task`: random-k's
seeded positions, EF-signSGD's and the vote's signs, in a few lines of host code), whose
payload the bridge then reads with the method's codec (:meth:`PhoneExport.phone_codec`); the
DGCConfig still gives its layer policy;
``phone_refusals`` names the run keys it has that the exported encoder does not run, so that a
run with phones is refused before they train otherwise than the simulated clients beside them.
A method without it is refused by the bridge and ``export`` in one line (:func:`phone_refusal`):
what it needs that the phone path lacks (its ``phone_needs``) and the methods phones run.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dgc import DGCConfig
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.payloads import Codec
from fedgc.methods.registry import registered

__all__ = ["PhoneExport", "phone_codec_of", "phone_export_of", "phone_methods", "phone_refusal"]

#: What phones run, for a refusal.
PHONE_ENCODER = "DGC's top-k exported with ExecuTorch, or a method's encoder on the host"
#: A method that declares no ``phone_needs`` (a plugin's, say) lacks at least this.
UNDECLARED = "a phone export (fedgc.methods.PhoneExport), which it does not declare"


class PhoneExport:
    """The opt-in part of a :class:`fedgc.methods.Method` that phones run: inherit it beside
    Method and override :meth:`phone_config`."""

    phone: ClassVar[bool] = True

    def phone_config(self, train: TrainSettings) -> DGCConfig:
        """The DGC configuration a phone's exported encoder runs for this method."""
        raise NotImplementedError

    def phone_small(self, train: TrainSettings) -> tuple[float, int] | None:
        """The density a phone sends its small sparsified tensors at and the size, in entries,
        up to which a tensor is small (as :class:`dgc.TwoDensityCompressor` does in this
        method's compressor); None: every tensor at the config's density."""
        return None

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        """What a phone's task carries beside its training keys and DGC config when its
        phones run an encoder of the method's own instead of the exported one: ``{"encoder":
        name, "payload": kind, ...}``, that encoder (``android_bridge.host_encoders``), the
        kind of :meth:`phone_codec` and what the encoder needs (a seed);
        {} (here): the exported encoder, whose update is a ``dgc.encode``-d ``FGCU``."""
        return {}

    def phone_codec(self) -> Codec | None:
        """The codec of the payload :meth:`phone_task` names, with which the bridge reads a
        phone's upload; None (here): the exported encoder's ``FGCU`` update."""
        return None

    def phone_values(self) -> dict[str, float]:
        """Values a phone of the exported encoder rounds to a power-of-two grid on the host,
        sent in its task's ``values`` entry (``android_bridge.phone``): ``shared_levels`` for
        the residual at the round's sets, ``levels`` for the encoder's top-k; {} (here):
        neither, the sets answered with signs and the values in the config's dtype."""
        return {}

    def phone_refusals(self) -> list[str]:
        """Its own keys (``key=value``, from ``self.own``) set to what phones do not run as
        this method's simulated clients do: a run that sets one is refused before phones
        train. None here."""
        return []


def phone_export_of(method: Method) -> PhoneExport | None:
    """``method``'s phone export part, None when phones do not run it (a subclass may turn it
    off with ``phone = False``)."""
    return method if isinstance(method, PhoneExport) and method.phone else None


def phone_methods() -> list[str]:
    """The registered methods phones run (:class:`PhoneExport`)."""
    return [m.name for m in registered() if phone_export_of(m) is not None]


def phone_refusal(method: Method) -> str | None:
    """Why phones do not run ``method``, in one line: what it needs that the phone path lacks
    (``Method.phone_needs``) and the methods phones run; None when they run it."""
    if phone_export_of(method) is not None:
        return None
    needs = method.phone_needs or UNDECLARED
    return (f"method {method.name!r} is not served by phones: it needs {needs}; phones run "
            f"{phone_methods()} ({PHONE_ENCODER})")


def phone_codec_of(kind: str) -> Codec:
    """The codec of a phone-side payload ``kind`` (a task's ``codec.payload``), from the
    registered methods phones run (methods of one kind read its bytes alike: efsign's and the
    vote's ``signs``; the server checks a payload with its method's own); ValueError naming
    the kinds there are."""
    codecs = {}
    for m in registered():
        part = phone_export_of(m)
        codec = part.phone_codec() if part is not None else None
        if codec is not None:
            codecs[codec.kind] = codec
    if kind not in codecs:
        raise ValueError(f"phone payload {kind!r} is not one phones send; they send "
                         f"{sorted(codecs)} besides the exported encoder's FGCU update")
    return codecs[kind]
