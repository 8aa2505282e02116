"""Flower 1.42's SecAgg+ compute, timed with its own code, for `secagg_bench.py`.

Flower's SecAgg+ runs only inside its legacy workflow (a ServerApp with
`SecAggPlusWorkflow`, ClientApps with `secaggplus_mod`), whose messaging floor
(polling, one process per message) would swamp the compute. So this times the
compute alone, with Flower's functions:

- **client**: one client's four stage functions of `secaggplus_mod` (`_setup`,
  `_share_keys`, `_collect_masked_vectors`, `_unmask`) on real inputs: its k
  neighbours run their own stages 0 and 1 (untimed) so that it receives real public
  keys and encrypted shares. Same n, k (``share_num = k + 1``) and t as fedtrain's;
  Flower's default quantization (2^22 levels, clipping range 8) and 2^32 modulus.
- **server**: what `SecAggPlusWorkflow` computes after the uploads: decoding and
  summing the n masked vectors mod 2^32 (its collect stage), then, per client,
  rebuilding the self-mask seed from t Shamir shares (`combine_shares`), expanding
  the mask (`pseudo_rand_gen`) and subtracting it, and dequantizing (its unmask
  stage), as that stage's code does it. Masked vectors are random uint32 values
  (the server's work does not depend on them); shares are real.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.client.mod.secure_aggregation.secaggplus_mod import (
    SecAggPlusState,
    _collect_masked_vectors,
    _setup,
    _share_keys,
    _unmask,
)
from flwr.common import bytes_to_ndarray, ndarray_to_bytes, ndarrays_to_parameters
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

QUANTIZATION_RANGE = 4_194_304  # SecAggPlusWorkflow's defaults
CLIPPING_RANGE = 8.0
MOD_RANGE = 1 << 32
MAX_WEIGHT = 1000.0


def _client_seconds(n: int, update: np.ndarray, weight: float, k: int, t: int) -> float:
    """One client's four stages among its k neighbours (node ids 1..k+1; it is 1)."""
    group = list(range(1, k + 2))
    states = {nid: SecAggPlusState(nid=nid) for nid in group}
    setup: dict[str, Any] = {
        Key.SAMPLE_NUMBER: n,
        Key.SHARE_NUMBER: k + 1,
        Key.THRESHOLD: t,
        Key.CLIPPING_RANGE: CLIPPING_RANGE,
        Key.TARGET_RANGE: QUANTIZATION_RANGE,
        Key.MOD_RANGE: MOD_RANGE,
        Key.MAX_WEIGHT: MAX_WEIGHT,
    }
    me = states[1]
    start = time.process_time()
    keys = {1: _setup(me, setup)}
    seconds = time.process_time() - start
    for nid in group[1:]:
        keys[nid] = _setup(states[nid], setup)
    broadcast = {
        str(nid): (keys[nid][Key.PUBLIC_KEY_1], keys[nid][Key.PUBLIC_KEY_2]) for nid in group
    }
    start = time.process_time()
    _share_keys(me, broadcast)
    seconds += time.process_time() - start
    srcs, ciphertexts = [], []
    for nid in group[1:]:
        out = _share_keys(states[nid], broadcast)
        srcs.append(nid)
        ciphertexts.append(out[Key.CIPHERTEXT_LIST][out[Key.DESTINATION_LIST].index(1)])
    parameters = ndarrays_to_parameters([update])
    routed = {Key.CIPHERTEXT_LIST: ciphertexts, Key.SOURCE_LIST: srcs}
    start = time.process_time()
    _collect_masked_vectors(me, routed, int(weight), parameters)
    _unmask(me, {Key.ACTIVE_NODE_ID_LIST: group, Key.DEAD_NODE_ID_LIST: []})
    return seconds + time.process_time() - start


def _server_seconds(n: int, m: int, t: int) -> float:
    """The workflow's collect and unmask computations over n clients, no dropouts."""
    rng = np.random.default_rng(0)
    uploads = [
        [
            ndarray_to_bytes(np.array([rng.integers(1, 1000)])),
            ndarray_to_bytes(rng.integers(0, MOD_RANGE, m)),
        ]
        for _ in range(n)
    ]
    shares = [create_shares(os.urandom(32), t, t) for _ in range(n)]
    start = time.process_time()
    masked: list[np.ndarray] | None = None
    for upload in uploads:
        vector = [bytes_to_ndarray(b) for b in upload]
        masked = vector if masked is None else parameters_addition(masked, vector)
    assert masked is not None
    masked = parameters_mod(masked, MOD_RANGE)
    shapes = [a.shape for a in masked]
    for share_list in shares:
        secret = combine_shares(share_list)
        masked = parameters_subtraction(masked, pseudo_rand_gen(secret, MOD_RANGE, shapes))
    _, recon = factor_extract(parameters_mod(masked, MOD_RANGE))
    dequantize(recon, CLIPPING_RANGE, QUANTIZATION_RANGE)
    return time.process_time() - start


def flower_compute(
    n: int, updates: Sequence[np.ndarray], weights: Sequence[float], k: int, t: int
) -> dict[str, float]:
    """Seconds of one Flower client's stages (client 0's update) and of its server."""
    return {
        "client": _client_seconds(n, updates[0], weights[0], k, t),
        "server": _server_seconds(n, updates[0].shape[0], t),
    }
