"""Client-level differential privacy for every method (DP-FedAvg, McMahan et al., ICLR 2018):
clipping (``clipping.py``), noise on the server or in shares among the clients (``noise.py``),
and the privacy spent from ``dp-accounting`` (``accountant.py``). docs/privacy.md says where the
guarantee's boundary is under compression and error feedback."""

from fedgc.privacy.dp.accountant import (
    DiscreteGaussianAccountant,
    GaussianAccountant,
    Guarantee,
    subsampled_rdp,
)
from fedgc.privacy.dp.clipping import AdaptiveClip, clip_update, clip_vector, l2_norm
from fedgc.privacy.dp.noise import DistributedDiscreteGaussian, add_central_noise, discrete_gaussian

__all__ = ["AdaptiveClip", "DiscreteGaussianAccountant", "DistributedDiscreteGaussian",
           "GaussianAccountant", "Guarantee", "add_central_noise", "clip_update", "clip_vector",
           "discrete_gaussian", "l2_norm", "subsampled_rdp"]
