"""Bounds on one client's sway over a round's aggregate: a cap on its weight and a clip of its
update's norm, both relative to the round's median over its valid replies.

The defence stage of the server's aggregation, before the combine (:mod:`server.aggregation`):
it reads each payload through :class:`fedgc.methods.Payload` (its norm), so it holds for every
method and payload kind.

A client claims its weight (``num-examples``) and sends its update; without bounds a claim of
1e12 examples, or values of 1e30, make that one update the whole aggregate. Both bounds leave an
honest round untouched (the weights and factors are then exactly the claims and 1.0, so results
are bit for bit those of plain FedAvg) and are reported in the client's row. Clipping, rather
than rejecting, keeps an honest client whose update grew (a residual that gathered several
missed rounds) in the federation: a rejected update would come back larger every round.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dgc import SparseUpdate
from fedgc.methods import SparsePayload
from server.replies import CheckedReply

#: The words of a bounded client's note (its row's ``reason``), counted by :func:`in_force`.
CAPPED, CLIPPED = "capped at", "clipped to"
#: The words of the note of an update the direction gate left out (server.aggregation.Combine).
LEFT_OUT = "left out"


#: What the direction gate takes an update's cosine with, by ``gate_reference``.
GATE_WORDS = {"history": "the last round's aggregate",
              "trend": "the aggregates' moving average",
              "round": "this round's centered clipping"}


def left_out_note(cosine: float, min_cosine: float, gate_reference: str = "history",
                  record: float | None = None) -> str:
    """The row's reason of an update the direction gate left out: its cosine below the bar,
    or (``record``) a repeat offender's record (``gate_memory``) though its cosine passed."""
    if record is not None:
        return (f"{LEFT_OUT}: a repeat offender (record {record:.3g} of recent left-outs, "
                f"gate_memory), though its cosine {cosine:.3g} with "
                f"{GATE_WORDS[gate_reference]} passed min_cosine {min_cosine:g}")
    return (f"{LEFT_OUT}: cosine {cosine:.3g} with {GATE_WORDS[gate_reference]}, below "
            f"min_cosine {min_cosine:g}")


def update_norm(update: SparseUpdate, signs: SparseUpdate | None = None) -> float:
    """The L2 norm of a decoded update and its signs together, in float64
    (:meth:`fedgc.methods.Payload.norm`, which the bounds use for every payload kind)."""
    return SparsePayload(update, [] if signs is None else [signs]).norm()


@dataclass(frozen=True)
class Bounds:
    """How far one client may move the aggregate.

    Parameters
    ----------
    max_weight_ratio : float (default: 4.0)
        A client's weight is at most this times the median weight claimed by the round's valid
        replies (0: no cap). The digits runs of the snapshots reach 2.1 at most with the
        default Dirichlet partition.
    max_norm_ratio : float (default: 10.0)
        A client's update (with its signs) is scaled down to at most this times the median norm
        of the round's valid replies (0: no clip).

    With fewer than three valid replies the median is not robust to one outlier: the bounds
    then hold only against a client that is not among the median's own.
    """

    max_weight_ratio: float = 4.0
    max_norm_ratio: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_weight_ratio", "max_norm_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (value == 0 or (math.isfinite(value) and value >= 1)):
                raise ValueError(f"{name} must be 0 (off) or a finite number >= 1, got "
                                 f"{value!r}")

    def apply(self, chosen: list[CheckedReply], valid: list[CheckedReply],
              ) -> tuple[list[float], list[float], dict[int, str]]:
        """(weight, update factor) per reply of ``chosen``, and a note per bounded client key.

        ``valid``: every valid reply of the round, the reference of both medians.
        """
        weights = [float(c.num_examples) for c in chosen]
        factors = [1.0] * len(chosen)
        notes: dict[int, list[str]] = {}
        if self.max_weight_ratio and valid:
            cap = self.max_weight_ratio * statistics.median(c.num_examples for c in valid)
            for i, c in enumerate(chosen):
                if weights[i] > cap:
                    weights[i] = cap
                    notes.setdefault(c.client_key, []).append(
                        f"weight {c.num_examples} {CAPPED} {cap:g}")
        if self.max_norm_ratio and valid:
            norms = {c.client_key: c.payload.norm() for c in valid if c.payload is not None}
            bound = self.max_norm_ratio * statistics.median(norms.values())
            for i, c in enumerate(chosen):
                norm = norms[c.client_key]
                if norm > bound:
                    factors[i] = bound / norm
                    notes.setdefault(c.client_key, []).append(
                        f"update norm {norm:.3g} {CLIPPED} {bound:.3g}")
        return weights, factors, {k: "; ".join(v) for k, v in notes.items()}


def describe(max_weight_ratio: float, max_norm_ratio: float, aggregation: str,
             trim_fraction: float, min_cosine: float = -1.0, bucket_size: int = 1,
             gate_reference: str = "history", gate_memory: float = 0.0,
             gate_memory_below: float = 0.0, gate_first_bar: float | None = None,
             clip_radius_clean: float = 0.0) -> str:
    """The defences a run aggregates with, in one line (the run's header), each with the key
    that sets it, and what plain FedAvg would take instead: they make the ``dense`` method
    something other than plain FedAvg where a client claims far more examples than the others,
    or sends a far larger update.

    >>> describe(0, 0, "mean", 0.1)
    'defences: none, plain FedAvg (the weighted mean of the updates)'
    >>> describe(1, 0, "centered_clip", 0.1)  # doctest: +NORMALIZE_WHITESPACE
    "defences: a client's weight capped at the round's median (max_weight_ratio=1); updates
    combined by centered clipping around last round's aggregate (aggregation=centered_clip);
    plain FedAvg would take max_weight_ratio=0 aggregation=mean"
    """
    how = {"mean": "the weighted mean",
           "median": "the coordinate-wise median",
           "trimmed_mean": f"the coordinate-wise mean trimmed of {trim_fraction:g} at each end",
           "centered_clip": "centered clipping around last round's aggregate",
           "fltrust": "FLTrust on the server's root set"}
    parts, plain = [], []
    if max_weight_ratio:
        times = "" if max_weight_ratio == 1 else f"{max_weight_ratio:g}x "
        parts.append(f"a client's weight capped at {times}the round's median "
                     f"(max_weight_ratio={max_weight_ratio:g})")
        plain.append("max_weight_ratio=0")
    if max_norm_ratio:
        parts.append(f"an update clipped to {max_norm_ratio:g}x the round's median norm "
                     f"(max_norm_ratio={max_norm_ratio:g})")
        plain.append("max_norm_ratio=0")
    if min_cosine > -1:
        reference = GATE_WORDS[gate_reference]
        key = "" if gate_reference == "history" else f", gate_reference={gate_reference}"
        held = ", and a repeat offender's while its record is bad" if gate_memory > 0 else ""
        key += f", gate_memory={gate_memory:g}" if gate_memory > 0 else ""
        if gate_memory > 0 and gate_memory_below < min_cosine:  # not every left-out counts
            held = (f", and a repeat offender's (a record opened below cosine "
                    f"{gate_memory_below:g}) while its record is bad")
            key += f", gate_memory_below={gate_memory_below:g}"
        first = ""
        if gate_memory > 0 and gate_first_bar is not None and gate_first_bar < min_cosine:
            first = f" (a client without a record below {gate_first_bar:g})"
            key += f", gate_first_bar={gate_first_bar:g}"
        parts.append(f"updates left out below cosine {min_cosine:g}{first} with {reference}"
                     f"{held} (min_cosine={min_cosine:g}{key})")
        plain.append("min_cosine=-1")
    if aggregation != "mean":
        if aggregation == "centered_clip" and bucket_size > 1:
            parts.append(f"updates combined by centered clipping around last round's aggregate "
                         f"of bucket means, {bucket_size} random clients each "
                         f"(aggregation={aggregation}, bucket_size={bucket_size})")
        elif aggregation == "centered_clip" and min_cosine > -1 and clip_radius_clean > 0:
            parts.append(f"updates combined by {how[aggregation]}, at radius "
                         f"{clip_radius_clean:g} in a round the gate found clean "
                         f"(aggregation={aggregation}, clip_radius_clean={clip_radius_clean:g})")
        else:
            parts.append(f"updates combined by {how.get(aggregation, aggregation)} "
                         f"(aggregation={aggregation})")
        plain.append("aggregation=mean")
    if not parts:
        return "defences: none, plain FedAvg (the weighted mean of the updates)"
    return f"defences: {'; '.join(parts)}; plain FedAvg would take {' '.join(plain)}"


def in_force(max_weight_ratio: float, max_norm_ratio: float, aggregation: str,
             trim_fraction: float, min_cosine: float, reasons: list[str],
             rejected: list[str]) -> dict[str, object]:
    """``summary.json``'s ``defences``: the settings, how many aggregated updates were capped
    or clipped (``reasons``: the aggregated rows' notes) and how many the direction gate left
    out (``rejected``: the rejected rows' reasons)."""
    return {"max_weight_ratio": max_weight_ratio, "max_norm_ratio": max_norm_ratio,
            "aggregation": aggregation, "trim_fraction": trim_fraction,
            "min_cosine": min_cosine,
            "weights_capped": sum(CAPPED in r for r in reasons),
            "updates_clipped": sum(CLIPPED in r for r in reasons),
            "updates_left_out": sum(r.startswith(LEFT_OUT) for r in rejected)}
