"""Differential privacy: clipping, CSPRNG noise (continuous and discrete), accounting.

Central DP lives in the `dpfedavg` strategy (the server clips and adds Gaussian
noise); the discrete sampler is for sites that add noise under secure aggregation.
"""

from fedtrain.privacy.accounting import PrivacyAccountant
from fedtrain.privacy.clipping import AdaptiveClip, clip_update, update_norm
from fedtrain.privacy.noise import discrete_gaussian, gaussian

__all__ = [
    "AdaptiveClip",
    "PrivacyAccountant",
    "clip_update",
    "discrete_gaussian",
    "gaussian",
    "update_norm",
]
