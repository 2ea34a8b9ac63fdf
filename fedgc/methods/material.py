"""Round material, an opt-in part of a method: what the server sends every sampled client beside
the model, and the reply's part that answers it.

DGC's shared index sets (each client sends its residual there as signs), TCS's mask (values
there, without indices) and PowerSGD's shared matrix are round material. A method that sends
some inherits :class:`RoundMaterial` beside :class:`fedgc.methods.Method`; the server builds its
:class:`Channel` (the server half: plan each round's bytes, learn from the aggregate), and the
client reads the bytes, may derive them further from the model it holds, starts local training
(:meth:`RoundMaterial.prepare`) and answers them. A method without it is sent no material, and a
reply with a side part is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from dgc import Compressor, SparseUpdate
from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.payloads import Bound

__all__ = ["Channel", "RoundMaterial", "material_of", "pending_parts"]

#: A model by tensor name (float32).
Model = Mapping[str, torch.Tensor]


class Channel:
    """The server half of a method's round material: what every sampled client of a round is
    sent beside the model (DGC's shared index sets; a shared matrix, a mask, a seed), and what
    the server learns from each round's aggregate to plan the next.

    The client half is :class:`RoundMaterial`'s ``read_material``, ``side_part`` and
    ``read_side`` (the reply's part that answers the material).
    """

    def hold(self, sent_model: Model, version: int, initial_on_grid: bool) -> None:
        """The model sampled clients hold (version 0 from ``set_model``, also before a resume,
        then each round's before :meth:`plan`; ``initial_on_grid``: version 0 has its matrices
        on the int8 grid, ``dgc.int8_grid.round_initial``). For a channel whose material
        clients derive from the model they hold (DGC's sets ranked by displacement); does
        nothing here."""

    def plan(self, server_round: int) -> tuple[bytes, object] | None:
        """This round's material: its bytes (sent) and its decoded form (what replies are
        checked against, :attr:`Bound.material`); None: nothing this round."""
        return None

    def observe(self, aggregate: Model) -> None:
        """The round's applied aggregate (model space)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What the channel keeps across rounds, for the checkpoint."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""


class RoundMaterial:
    """The opt-in part of a :class:`fedgc.methods.Method` that sends round material: inherit it
    beside Method (``class Mine(Method[MySettings], RoundMaterial)``) and override
    :meth:`channel` and :meth:`read_material`; the rest has defaults."""

    name: str

    # ------------------------------------------------------------------ server half
    def channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        """The server half of the round material for a model of ``shapes``; None: none."""
        return None

    # ------------------------------------------------------------------ client half
    def read_material(self, data: bytes, numels: Mapping[str, int]) -> object:
        """The round material of a train message, decoded (a DecodeError or ValueError for
        bytes that do not decode)."""
        raise ValueError(f"method {self.name!r} sends no round material")

    def hold_material(self, data: bytes, material: object, model: Model,
                      initial: Callable[[], dict[str, torch.Tensor]],
                      held: tuple[int, Model] | None = None) -> tuple[bytes, object]:
        """The round material once the client holds the round's ``model`` (``initial()``
        builds version 0 from the run's seed; ``held``: the version and the model the client
        kept from its last round, None without one): as read, here. A method whose material
        clients derive from the models (DGC's sets ranked by displacement; its aggregate
        feedback's reference) returns it derived, with bytes that :meth:`read_material` reads
        back to the same up to what only this client holds (kept to fold the side part back,
        :func:`pending_parts`)."""
        return data, material

    def prepare(self, train: TrainSettings, compressor: Compressor, model: dict[str, torch.Tensor],
                rounds_away: int) -> dict[str, torch.Tensor]:
        """Before local training, with the client's state loaded (and an update the server did
        not aggregate folded back): the model local training starts from (here ``model``, the
        one sent). ``rounds_away``: rounds since this client's last update, less one (0 for a
        client sampled in consecutive rounds; -1 for none). A method may act on the residual
        (DGC's aged residuals and step-ahead); the pseudo-gradient is taken against the model
        sent either way."""
        return model

    def side_part(self, compressor: Compressor, material: object,
                  server_round: int) -> tuple[bytes, int] | None:
        """The reply's part that answers the round material, and the entries it carries
        (taken from the compressor's residual); None: none."""
        return None

    def read_side(self, data: bytes, material: object,
                  shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
        """A reply's side part as a sparse update of the model (both ends: the server
        aggregates it, a client restores it); DecodeError or ValueError when it is bad."""
        raise ValueError(f"method {self.name!r} takes no side part")


def material_of(method: Method) -> RoundMaterial | None:
    """``method``'s round material part, None for a method that sends none."""
    return method if isinstance(method, RoundMaterial) else None


def pending_parts(method: Method, train: TrainSettings, pending: bytes, side: bytes | None,
                  material: bytes | None, shapes: Mapping[str, tuple[int, ...]],
                  ) -> tuple[int, list[SparseUpdate]]:
    """(sequence, sparse updates) of what a client of ``method`` sent and stored (``pending``;
    with the round's material, ``material``, the bytes the server sent, which the payload and
    the side part answered): what it folds back when the server did not aggregate it. The
    client's own bytes: bounded by the model's sizes."""
    numels = {n: int(np.prod(s)) for n, s in shapes.items()}
    part = material_of(method)
    if material is not None and part is None:
        raise ValueError(f"method {method.name!r} sends no round material, but a stored "
                         f"update answers some")
    answered = None if material is None or part is None else part.read_material(material, numels)
    payload = method.codec(train).decode(pending, Bound(shapes, material=answered))
    parts = payload.parts()
    if side is not None and answered is not None and part is not None:
        parts.append(part.read_side(side, answered, {n: (numels[n],) for n in numels}))
    return payload.sequence, parts
