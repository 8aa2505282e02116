"""Secure aggregation: SecAgg+ (Bell et al. 2020) on the stages of Bonawitz et al. 2017.

The server learns the (weighted) sum of the surviving sites' updates and nothing else
about any one of them. Pure state machines (:class:`SecAggClient`,
:class:`SecAggServer`) take messages and return messages; the runtime moves them over
gRPC, the simulation in memory (:func:`run_in_memory`).

Threat model
============

Assumed: an **honest-but-curious server** (it runs the protocol as written but tries to
learn from everything it sees), sites that generate their keys and secrets locally
with the OS CSPRNG, a transport with mutual TLS (the runtime's job), and fresh
protocol objects (fresh keys, fresh seeds) every round.

What the **server** learns: the sum over the included sites of their clipped,
weight-multiplied, quantized updates; the sum of their weights (so the weighted mean);
which sites were included and which dropped at which stage; message sizes and timing.
It does **not** learn any single site's update or weight, nor the sum over any strict
subset of the included sites: every masked vector is uniformly random in Z_{2^32}^m,
pairwise masks cancel only in the full sum, and each site reveals the shares of *one*
of a peer's two secrets (seed ``b`` if the peer survived, mask key ``s^sk`` if it
dropped), never both, with threshold ``t > (k + 1) / 2``.

What **another site** learns: its neighbours' public keys and fewer than ``t`` Shamir
shares of their secrets, which say nothing (information-theoretically). Shares travel
AES-GCM encrypted site-to-site, so the server that routes them cannot read them. Sites
see whatever the server later publishes (the aggregate model), no more.

What a **network observer** learns: with mTLS, sizes and timing only. Without TLS it
would see exactly what the server sees, including the unmasking shares, hence the sum
(never an individual update); and it could tamper, so TLS is required.

**Collusion bound**: the server colluding with a set C of sites learns nothing beyond
the sum of the honest included sites (plus C's own inputs) as long as no honest site
has ``t`` or more of its ``k + 1`` share holders in C and the honest survivors stay
connected in the neighbour graph. With the complete graph (``k = n - 1``) this is
classic SecAgg: any ``t - 1`` colluding sites. :func:`choose_degree` sizes ``k`` and ``t``
so that this holds except with a stated probability for a given corruption rate.

**The sum itself leaks** what any sum leaks: with two sites, each learns the other's
update from the aggregate minus its own. Add differential privacy (``fedtrain.privacy``)
when that matters; a site refuses to unmask if fewer than ``t`` of its share owners
survived.

What a **malicious server** could do (not defended here): send a site forged public
keys for its neighbours (no key is bound to a site identity, so it can man-in-the-middle
the share encryption and collect both secrets); tell different sites inconsistent
dropout stories (limited by ``t > (k + 1) / 2`` only while it has no colluding sites);
choose the graph seed or the surviving set to surround a target with colluders; report
a wrong sum. Defending against it needs: each site signing its advertised keys with its
mTLS certificate key and verifying its neighbours' signatures; the Bonawitz
consistency-check round (sites sign the list of survivors and verify each other's
signatures before unmasking); a graph seed from commit-reveal or a public beacon; a
minimum survivor count agreed out of band; and verifiable aggregation to detect a
wrong sum.
"""

from __future__ import annotations

from fedtrain.secagg.aggregator import ModularSumAggregator
from fedtrain.secagg.config import SecAggConfig
from fedtrain.secagg.crypto import KeyPair, MaskExpander
from fedtrain.secagg.graph import (
    check_threshold,
    choose_degree,
    effective_degree,
    neighbour_graph,
    neighbours_of,
)
from fedtrain.secagg.identity import (
    Identity,
    InMemoryPKI,
    SigningIdentity,
    VerifiedPeer,
    Verifier,
)
from fedtrain.secagg.inmemory import run_in_memory
from fedtrain.secagg.messages import (
    AdvertiseKeys,
    ClientMessage,
    ConsistencyRequest,
    ConsistencySignature,
    KeysBroadcast,
    MaskedInput,
    Message,
    RoundParams,
    RoutedShares,
    ServerMessage,
    SetupRequest,
    ShareKeys,
    UnmaskRequest,
    UnmaskShares,
    decode_message,
)
from fedtrain.secagg.protocol import SecAggClient, SecAggResult, SecAggServer, Stage
from fedtrain.secagg.quantize import Quantizer, max_bits_for

__all__ = [
    "AdvertiseKeys",
    "ClientMessage",
    "ConsistencyRequest",
    "ConsistencySignature",
    "Identity",
    "InMemoryPKI",
    "KeyPair",
    "KeysBroadcast",
    "MaskExpander",
    "MaskedInput",
    "Message",
    "ModularSumAggregator",
    "Quantizer",
    "RoundParams",
    "RoutedShares",
    "SecAggClient",
    "SecAggConfig",
    "SecAggResult",
    "SecAggServer",
    "ServerMessage",
    "SetupRequest",
    "ShareKeys",
    "SigningIdentity",
    "Stage",
    "UnmaskRequest",
    "UnmaskShares",
    "VerifiedPeer",
    "Verifier",
    "check_threshold",
    "choose_degree",
    "decode_message",
    "effective_degree",
    "max_bits_for",
    "neighbour_graph",
    "neighbours_of",
    "run_in_memory",
]
