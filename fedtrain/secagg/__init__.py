"""Secure aggregation: SecAgg+ (Bell et al. 2020) on the stages of Bonawitz et al. 2017.

The server learns the (weighted) sum of the surviving sites' updates and nothing else
about any one of them. Pure state machines (:class:`SecAggClient`,
:class:`SecAggServer`) take messages and return messages; the runtime moves them over
gRPC, the simulation in memory (:func:`run_in_memory`).

Threat model
============

Assumed: sites generate their keys and secrets locally with the OS CSPRNG and use fresh
protocol objects (fresh keys, fresh seeds) every round; the transport is mutual TLS
(the runtime's job); and, for everything said about a *malicious* server, each site
has an identity (`fedtrain.secagg.identity`: in the runtime an Ed25519 key endorsed by
its mTLS certificate, `fedtrain.runtime.secagg_identity`; in the simulation an
in-memory PKI). Notation: each site's two secrets (self-mask seed ``b``, mask key
``s^sk``) are Shamir-shared among its ``k`` graph neighbours and itself (``k + 1``
holders) with threshold ``t > (k + 1) / 2``; ``U3`` is the set of sites whose masked
input is in the sum.

**An honest-but-curious server** (runs the protocol as written, records everything)
learns the sum over ``U3`` of the sites' clipped, weight-multiplied, quantized updates;
the sum of their weights (so the weighted mean); which sites were included and which
dropped at which stage; message sizes and timing. It learns nothing about any single
site's update or weight, nor the sum over any strict subset of ``U3``: every masked
vector is uniformly random in Z_{2^32}^m; pairwise masks cancel only in the full sum,
and ``U3`` must be connected in the neighbour graph (the server, and every site,
refuse to unmask a survivor set in pieces, whose pieces' sums would otherwise come
out one by one); and all holders of a site reveal the same one of its two secrets
(seed ``b`` if it survived, mask key if it dropped).

**A malicious server** (deviates at will; no site colludes with it):

* It cannot substitute keys. With identities every site signs its advertised keys
  (round, secagg id, both public keys) and checks its neighbours' signatures before it
  encrypts a share to them, so only the intended neighbour can read a share.
  (Without identities, it could hand a site keys of its own for its neighbours and
  collect both secrets of any site.)
* **With the consistency check** (``consistency_check``, on by default; the runtime
  turns it off only without TLS), sites sign the survivor set they are told and a site
  reveals shares only when ``t`` of each share owner's holders signed the very set it
  signed, and the request follows from that set (`fedtrain.secagg.consistency`, where
  the rule is proved). The server then never gets both secrets of a site, and never
  the sum of fewer than ``t`` sites. What it can still do: leave out inputs it received
  (declare their senders dropped; their updates are simply not used); by telling
  disjoint groups of at least ``t`` sites different connected survivor sets, learn
  each group's sum instead of one total; choose the graph seed (who neighbours whom);
  abort any round; report a wrong sum (nothing is verifiable); and re-run a round with
  other participants and subtract (sites cannot tell a retry from a new round; fresh
  training randomness makes two attempts' updates differ, but not by much, so only
  differential privacy bounds what that reveals).
* **Without the check** it recovers a chosen site's exact update with no colluder:
  it tells some of the victim's holders the victim survived (they reveal seed shares)
  and the holders of the victim's neighbours that those dropped (they reveal mask
  keys, and every pair mask on the victim's input follows). Each request looks
  consistent on its own, so ``t > (k + 1) / 2`` does not stop it;
  ``tests/secagg/test_consistency.py`` runs this attack at n=40, k=8, t=5.

**Colluding sites.** Against an honest-but-curious server colluding with a set C of
sites, privacy holds for each honest site with fewer than ``t`` of its ``k + 1``
holders in C (``choose_degree`` sizes ``k`` and ``t`` for a corruption rate). Against
a malicious server the consistency check needs more: a corrupt holder signs anything,
so with ``c`` corrupt holders two groups need only ``t - c`` honest signers each, and
the guarantee holds while ``c <= 2t - (k + 1) - 1``, i.e. none for the smallest secure
``t``; ``t >= (k + 2 + c) / 2`` tolerates ``c`` (classic SecAgg's ``t > 2n/3``).

**A malicious site** learns nothing more than an honest one: its neighbours' signed
public keys and fewer than ``t`` shares of each secret. But it can **shift the sum
undetectably**: its masked vector is uniformly random to everyone, so nothing checks
that it encodes a clipped update and a weight within ``max_weight``; any value it adds
(mod 2^32, weight slot included) lands in the decoded sum. No input validation is
possible here without zero-knowledge range proofs. ``max_weight`` and clipping, and
distributed DP's clipping and noise, are enforced by each site's own code: they bound
honest sites, not a rogue one (robust aggregation, which needs individual updates,
cannot run under secure aggregation). It can also make a round fail (bad shares,
refusing to reveal).

**A network observer** sees, with mTLS, sizes and timing only. Without TLS it would
see what the server sees, unmasking shares included (hence the sum, never one update),
and could tamper: TLS is required.

**The sum itself leaks** what any sum leaks: with two sites, each learns the other's
update from the aggregate minus its own. Add differential privacy
(``fedtrain.privacy``) when that matters. A site refuses to reveal for fewer than ``t``
surviving share owners, and (with the check) for a survivor set smaller than ``t`` or
than the distributed-DP minimum; a lying server's group sums are over ``t`` or more
sites, so set ``t`` no lower than the DP minimum if that must hold against it too.

**Out of scope**: the graph seed is the server's choice, so a malicious server
colluding with sites can place them around a victim (a site-contributed or
commit-reveal seed does not fix this cheaply: the server still picks which sites'
contributions count after seeing them; a public randomness beacon would); verifiable
aggregation (proving the published model is the true sum); input validation (above).
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
