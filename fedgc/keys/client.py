"""The client's keys (part ``client``): local training, the compression density, its state store.

Sent in every train message (a client never trusts its own defaults for them). A key a client
reads for its local work goes here; a compression method's own keys go with the method
(:attr:`fedgc.methods.Method.settings`), and ``density`` is here because every compressing
method reads it (each may give its own default, ``fallback``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgc.schema import Check, SettingsError, setting

__all__ = ["UNAGGREGATED", "ClientKeys", "momentum_range"]

#: What an error-feedback client may do with an update the server never aggregated
#: (:mod:`fedgc.methods.unaggregated`).
UNAGGREGATED: tuple[str, ...] = ("keep", "decay", "cap", "discard")


def momentum_range() -> Check:
    """The range of a momentum factor: [0, 1)."""
    return Check(0.0, 1.0, high_open=True)


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs for its local round: optimizer, steps, the density it sends at."""

    PART = "client"

    local_epochs: int = setting(2, "local_epochs", "local passes over the client's data (used "
                                "when local_steps is 0)", Check(0))
    local_steps: int = setting(0, "local_steps", "local SGD steps per round; 0 = use "
                               "local_epochs; 1 = FedSGD-style rounds", Check(0))
    batch_size: int = setting(10, "batch_size", "local minibatch size", Check(1))
    lr: float = setting(0.1, "lr", "client SGD learning rate", Check(0.0, low_open=True))
    client_momentum: float = setting(0.5, "client_momentum", "client SGD momentum within a "
                                     "round (reset every round)", momentum_range())
    weight_decay: float = setting(0.0, "weight_decay", "client SGD weight decay (applied "
                                  "locally, never sent)", Check(0.0))
    # The range of DGCConfig's density, which every top-k method configures from it.
    density: float | None = setting(None, "density", "fraction of each sparsified tensor a "
                                    "client sends per round (after dgc.warmup_rounds); empty = "
                                    "the method's default", Check(0.0, 1.0, low_open=True),
                                    fallback=0.001)
    # What an error-feedback client does with an update the server never aggregated
    # (fedgc.methods.unaggregated); each such method gives its own default.
    unaggregated: str | None = setting(
        None, "unaggregated", "what an error-feedback client folds back into its residual of "
        "an update the server never aggregated (dropped, late, surplus, refused): keep (all of "
        "it), decay (unaggregated_decay ** its age in rounds, applied steps under mode = async), "
        "cap (at most unaggregated_cap times the residual's L2 norm) or discard; empty = the "
        "method's default",
        Check(choices=UNAGGREGATED), fallback="keep")
    unaggregated_decay: float | None = setting(
        None, "unaggregated_decay", "with unaggregated = decay: the share of an unaggregated "
        "update kept per round (applied step under mode = async) since it was computed; empty = "
        "the method's default", Check(0.0, 1.0), fallback=0.5)
    unaggregated_cap: float | None = setting(
        None, "unaggregated_cap", "with unaggregated = cap: the most an unaggregated update "
        "folded back may weigh, in L2 norms of the residual it joins; empty = the method's "
        "default", Check(0.0, 1000.0), fallback=1.0)
    state_dir: str = setting("", "state_dir", "folder of the per-client state store (residual, "
                             "pending update, held model); empty = <results>/<run>/client_state")

    def check_client_keys(self) -> None:
        """The rules between these keys."""
        if self.local_epochs == 0 and self.local_steps == 0:
            raise SettingsError("local_epochs and local_steps are both 0: set local_epochs >= 1 "
                                "or local_steps >= 1")
