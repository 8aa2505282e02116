"""Differential privacy: clipping, CSPRNG noise (continuous and discrete), accounting.

Central DP lives in the `dpfedavg` strategy (the server clips and adds Gaussian
noise). Distributed DP (`fedtrain.privacy.distributed`, imported on its own since it
builds on secure aggregation) has each site clip its update and add discrete Gaussian
noise to it before masking, calibrated so that the unmasked sum is private.
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
