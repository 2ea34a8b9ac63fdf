"""The privacy keys (part ``privacy``): secure aggregation and differential privacy of a run.

Composed into :class:`fedgc.keys.TrainSettings`: every client reads them for its round.

What the server's secure round (:mod:`server.privacy`) and a client's masked reply
(:mod:`client.secure`) read; sent in train messages only where a run turns one of them on
(:meth:`fedgc.settings.RunConfig.client_config`), so that a run without them sends what it sent
before they existed. docs/privacy.md says what each does to a round and to the guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedgc.schema import Check, SettingsError, setting

__all__ = ["DP_MODES", "PRIVACY_ACCOUNTANTS", "PrivacyKeys", "check_privacy"]

#: Where the Gaussian noise of DP-FedAvg is added: nowhere, by the server on the sum, or in
#: shares by the clients under secure aggregation (the distributed discrete Gaussian).
DP_MODES = ("off", "central", "distributed")
#: dp-accounting's accountants (fedgc.privacy.dp.accountant).
PRIVACY_ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class PrivacyKeys:
    """Secure aggregation and client-level differential privacy."""

    privacy_secagg: bool = setting(
        False, "privacy.secagg", "secure aggregation (SecAgg+): the server learns only the sum "
        "of the round's updates, at the coordinates every client knows (dense, fedavgm, "
        "randk, dgc_sets as its shared sets only, tcs with tcs.topk_share = 0, fetchsgd); "
        "four round trips a round (docs/privacy.md)")
    privacy_dp: str = setting(
        "off", "privacy.dp", "client-level DP-FedAvg: off; central (each update clipped to "
        "privacy.clip, Gaussian noise of std noise_multiplier x clip added to the sum by the "
        "server); distributed (with privacy.secagg: each client adds its share of discrete "
        "Gaussian noise before masking, sized for clients_per_round shares); epsilon is "
        "reported per round", Check(choices=DP_MODES))
    privacy_clip: float = setting(
        0.0, "privacy.clip", "L2 norm each client's contribution is clipped to: its "
        "pseudo-gradient before compression and the vector it adds to the sum (with "
        "privacy.clip_quantile: the first round's); 0 = none (needs privacy.dp = off)",
        Check(0.0))
    privacy_update_clip: float = setting(
        1.0, "privacy.update_clip", "the pseudo-gradient's clip before compression, as a "
        "multiple of privacy.clip (1: the clip itself; 0: none). The guarantee's clip is the "
        "vector's as it enters the sum, which the server (central) or the client (secure "
        "aggregation) still applies at privacy.clip; above 1 a method whose clients send its "
        "sets only (dgc_sets, tcs) lets them carry more of each update (docs/privacy.md)",
        Check(0.0))
    privacy_clip_quantile: float = setting(
        0.0, "privacy.clip_quantile", "adaptive clipping (Andrew et al., NeurIPS 2021): the "
        "fraction of clients whose update should fall within the clip; privacy.clip is then "
        "the first round's clip, which the server moves geometrically each round from the sum "
        "of the clients' clip bits (noised under DP, masked under privacy.secagg); 0 = a "
        "fixed clip", Check(0.0, 1.0, high_open=True))
    privacy_clip_learning_rate: float = setting(
        0.2, "privacy.clip_learning_rate", "adaptive clipping's step eta: the clip is "
        "multiplied by exp(-eta (fraction of bits - privacy.clip_quantile)) each round",
        Check(0.0, 10.0, low_open=True))
    privacy_noise_multiplier: float = setting(
        1.0, "privacy.noise_multiplier", "z: the noise's std on the sum is z x privacy.clip",
        Check(0.0))
    privacy_delta: float = setting(
        1e-5, "privacy.delta", "the delta epsilon is reported for (below 1/num_clients)",
        Check(0.0, 1.0, low_open=True, high_open=True))
    privacy_accountant: str = setting(
        "rdp", "privacy.accountant", "dp-accounting's accountant: rdp or pld",
        Check(choices=PRIVACY_ACCOUNTANTS))
    privacy_value_bits: int = setting(
        16, "privacy.value_bits", "secure aggregation's fixed point: bits of one client's "
        "coordinate (the modulus adds what the round's clients need)", Check(2, 40))
    privacy_value_range: float = setting(
        0.0, "privacy.value_range", "secure aggregation's fixed point: a coordinate is clamped "
        "to [-range, range] (clamped ones counted in secagg_saturated); 0 = privacy.clip, or "
        "1 without a clip", Check(0.0))
    privacy_neighbours: int = setting(
        0, "privacy.neighbours", "SecAgg+'s neighbours per client k (even); 0 = 2 ceil(2 "
        "log2 n), everyone up to 19 clients", Check(0))

    @property
    def private(self) -> bool:
        """Whether either mechanism is on."""
        return self.privacy_secagg or self.privacy_dp != "off"

    @property
    def adaptive_clip(self) -> bool:
        """Whether the clip adapts (``privacy.clip_quantile`` > 0)."""
        return self.privacy_clip_quantile > 0

    @property
    def fixed_point_range(self) -> float:
        """The fixed point's clamp: ``privacy.value_range``, else the clip, else 1."""
        return self.privacy_value_range or self.privacy_clip or 1.0


def check_privacy(train: Any, server: Any) -> None:
    """SettingsError (one line) unless the run's privacy keys go with its other keys:
    ``train`` (the clients' keys, PrivacyKeys among them) and ``server``'s. (Whether the run's
    method sums under masks, :func:`fedgc.privacy.linear.check_secure`, is checked beside.)"""
    if train.privacy_dp != "off" and train.privacy_clip <= 0:
        raise SettingsError(f"privacy.dp = {train.privacy_dp} needs privacy.clip > 0: the "
                            f"noise is sized to the clip")
    if train.privacy_dp != "off" and train.privacy_noise_multiplier <= 0:
        raise SettingsError(f"privacy.dp = {train.privacy_dp} needs privacy.noise_multiplier "
                            f"> 0, got {train.privacy_noise_multiplier:g}: without noise "
                            f"there is no epsilon to account")
    if train.privacy_update_clip != 1.0 and train.privacy_clip <= 0:
        raise SettingsError(f"privacy.update_clip = {train.privacy_update_clip:g} is a multiple "
                            f"of privacy.clip, which is 0 (no clip): set privacy.clip > 0")
    if train.adaptive_clip:
        _check_adaptive_clip(train)
    if train.privacy_dp == "distributed" and not train.privacy_secagg:
        raise SettingsError("privacy.dp = distributed needs privacy.secagg = true: the "
                            "server must see only the sum of the noised shares")
    if not train.privacy_secagg:
        return
    robust = {"aggregation": server.aggregation != "mean",
              "max_norm_ratio": bool(server.max_norm_ratio),
              "max_weight_ratio": bool(server.max_weight_ratio)}
    if on := [k for k, v in robust.items() if v]:
        raise SettingsError(f"privacy.secagg = true with {', '.join(on)} set: the server "
                            f"cannot weigh, bound or robustly combine masked updates; use "
                            f"aggregation = mean, max_norm_ratio = 0, max_weight_ratio = 0 "
                            f"(privacy.clip bounds each update)")
    if train.clients_per_round < 2:
        raise SettingsError("privacy.secagg = true needs clients_per_round >= 2: a secure sum "
                            "of one client is its update")
    if train.privacy_neighbours % 2:
        raise SettingsError(f"privacy.neighbours = {train.privacy_neighbours}: expected an "
                            f"even number (or 0, the default)")


def _check_adaptive_clip(train: Any) -> None:
    """SettingsError (one line) unless adaptive clipping goes with the run's other keys."""
    if train.privacy_clip <= 0:
        raise SettingsError(f"privacy.clip_quantile = {train.privacy_clip_quantile} needs "
                            f"privacy.clip > 0: the first round's clip")
    if train.privacy_dp != "central":
        raise SettingsError(f"privacy.clip_quantile with privacy.dp = {train.privacy_dp}: "
                            f"adaptive clipping sizes the clip central noise is scaled to "
                            f"(with distributed noise the clip bits would need discrete noise "
                            f"shares of their own, not built); use privacy.dp = central")
    # Andrew et al.: the bits' noise (std clients_per_round / 20) and the update's share one
    # noise multiplier z, which the bits alone must not exceed (2 sigma_b > z).
    count_noise = train.clients_per_round / 20
    if train.privacy_dp == "central" and 2 * count_noise <= train.privacy_noise_multiplier:
        raise SettingsError(
            f"privacy.clip_quantile with privacy.noise_multiplier = "
            f"{train.privacy_noise_multiplier:g} and clients_per_round = "
            f"{train.clients_per_round}: the clip bits' noise (std clients_per_round / 20 = "
            f"{count_noise:g}) alone spends a noise multiplier of {2 * count_noise:g}; expected "
            f"noise_multiplier < clients_per_round / 10 (more clients a round, or less noise)")
