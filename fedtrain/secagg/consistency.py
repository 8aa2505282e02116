"""The consistency check: what a site verifies before it reveals a single share.

Bonawitz et al. (CCS 2017) defend against a server that lies about who dropped out
with a *consistency check*: every survivor signs the survivor set ``U3`` it was told,
and reveals shares only after seeing at least ``t`` signatures of that same set.
There, every site holds a share of every other site, so ``t > n / 2`` signatures on
one set rule out a second set. In SecAgg+ a site's shares live only with its ``k``
graph neighbours and itself, so the count has to be taken **per share owner, among
that owner's share holders**, and the holders have to agree on who those holders are.

Notation: ``U1`` the sites that advertised keys (the graph is built over it), ``R(o)``
the share holders of owner ``o``: its neighbours in that graph, and ``o``
(``|R(o)| = d + 1``, ``d`` the graph's effective degree; ``t > (d + 1) / 2`` is
checked by every site). ``held(h)``: the owners whose shares ``h`` holds (``h`` itself
and the neighbours whose shares the server routed to it). ``U3_h``: the survivor set
``h`` signed.

The rule, at an honest site ``h`` (checked by :func:`check_survivor_set` when ``h``
signs and by :func:`check_reveal` before it reveals; the client also refuses a second
unmask request, as without the check):

* **R0, sealed view.** When ``h`` shares its secrets, it seals into every encrypted
  share (AES-GCM, under a key agreed with advertised keys whose signatures it checked)
  a commitment to its view: the round parameters, ``U1``, and the exact key
  advertisements (ids, keys, credentials) of ``R(h)``. See :func:`commitment`.
* **R1, one statement.** ``h`` signs one survivor set per round (a protocol instance
  signs once; the statement holds its own advertised keys, so a restarted instance's
  signature is another instance's), and only if ``h`` is in it, it lies within ``U1``,
  every neighbour of ``h`` in it shared keys with ``h``, it has at least ``t`` sites,
  at least the distributed-DP minimum and the round's ``min_included``, and it is
  connected in the graph (else each component's sum would be unmasked on its own: see
  ``graph.components``).
* **R2, the request follows the statement.** The unmask request asks for exactly the
  seed shares of ``held(h) ∩ U3_h`` and the mask-key shares of ``held(h) - U3_h``;
  at least ``t`` of ``held(h)`` survived.
* **R3, t signatures per owner.** For every owner ``o`` in ``held(h)``: the
  advertisements ``h`` uses for ``R(o)`` (its own and its neighbours', checked when
  they came; the others forwarded by the server) reproduce the commitment ``o``
  sealed into its shares for ``h``; their certified names are distinct; and at least
  ``t`` members of ``R(o)`` signed ``U3_h`` itself (``h`` counts). A neighbour of ``h``
  may vouch by a MAC under the key only it and ``h`` derived from their checked
  share-encryption keys (`crypto.attestation_key`) instead of its Ed25519 signature:
  to ``h`` that is as good (nobody else can make it) and costs a hash, not a
  signature check. Its MACs and its signature are over the same one statement.

**Theorem 1 (never both secrets).** Let ``o`` be honest and the server collude with no
site in ``R(o)``. No two honest holders ``h1, h2`` of ``o`` reveal different kinds of
share of ``o``. *Proof.* Say ``h1`` reveals a seed share and ``h2`` a mask-key share
of ``o``. By R2, ``o ∈ U3_h1`` and ``o ∉ U3_h2``, so the two statements differ. Both
hold ``o``'s shares, so both opened ``o``'s commitment, authenticated by AES-GCM under
keys the server could not substitute; by R3 both counted signatures from the same
``|R(o)|`` protocol instances, the ones ``o`` committed to. ``h1`` counted ``t`` of them
on ``U3_h1``, ``h2`` counted ``t`` on ``U3_h2``; by R1 each honest instance signed one
statement, so these are disjoint groups: ``2t <= |R(o)|``, against ``t > |R(o)| / 2``.
Each holder reveals at most once, so the server gets ``t`` shares of one secret of
``o`` at most. (The owner's commitment is what pins the group: without it, a server
that told ``h1`` and ``h2`` different ``U1`` or different keys for an id would make them
count signatures from different groups.)

**Theorem 2 (no sum over fewer than t sites).** With no colluding site, the server
learns nothing about ``sum_{u in A} x_u`` for any set ``A`` of fewer than ``t`` honest
sites short of the whole round. *Proof.* Site ``v``'s masked input carries its self
mask (seed ``b_v``) and a pair mask with each neighbour ``j`` in ``J_v``, the senders
whose shares reached ``v`` (``|J_v| >= t - 1``, or ``v`` aborts). Unmasking the sum over
``A`` needs ``b_v`` for every ``v`` in ``A`` and, for each pair mask leaving ``A``
(``j ∈ J_v - A``), ``j``'s mask key (``v``'s own is excluded by Theorem 1). By Theorem 1
each owner has one status, "survived" (``t`` seed shares) or "dropped" (``t`` key
shares). A "dropped" ``j`` reveals nothing itself: its own request would list it as
survived (R1, R2), which needs ``t`` signatures of ``R(j)`` on a set containing ``j``,
disjoint from the ``t`` on the sets without it. So ``b_v``'s ``t`` shares come from
``v``'s holders outside ``J_v - A``: the ``d - |J_v| <= t - 1`` neighbours that did not
send to ``v``, plus sites of ``A`` — and a site ``u`` of ``A`` reveals only if ``t`` of
``held(u)`` are in ``U3_u`` (R2), all of them "survived" and so in ``A`` (a survived
sender of ``u`` outside ``A`` would leave an unremovable pair mask): ``|A| >= t``. So
for ``|A| < t`` no site of ``A`` reveals, and ``b_v`` has at most ``t - 1`` shares.

**What the server can still do.** It can report a survivor set that excludes sites
whose inputs it has (their inputs are then simply not used), pick the graph seed, and,
by telling different groups different connected survivor sets, learn the sums of
several disjoint groups of at least ``t`` sites each, where an honest server learns
one sum. **Colluding sites** weaken Theorem 1: with ``c`` corrupt holders in ``R(o)``
(they sign anything), two groups need only ``t - c`` honest signers each, so the
guarantee holds while ``c <= 2t - |R(o)| - 1`` (zero for the smallest secure ``t``;
raise ``t`` to tolerate colluders, as classic SecAgg's ``t > 2n/3``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence

from fedtrain.errors import SecAggError
from fedtrain.secagg import crypto
from fedtrain.secagg.graph import components
from fedtrain.secagg.identity import VerifiedPeer, Verifier, survivors_statement
from fedtrain.secagg.messages import AdvertiseKeys, RoundParams
from fedtrain.secagg.round_ids import describe

COMMITMENT_BYTES = 32
_DOMAIN = b"fedtrain/secagg/v1/holders"


def holders(owner: int, graph: Mapping[int, frozenset[int]]) -> frozenset[int]:
    """``R(owner)``: its neighbours in the graph over ``U1``, and itself."""
    return graph[owner] | {owner}


def entry(advert: AdvertiseKeys) -> bytes:
    """A digest of one advertisement (id, both keys, the credential)."""
    credential = hashlib.sha256(advert.credential).digest()
    return hashlib.sha256(
        struct.pack("<II", advert.site, len(advert.enc_key))
        + advert.enc_key
        + struct.pack("<I", len(advert.mask_key))
        + advert.mask_key
        + credential
    ).digest()


def view(params: RoundParams, alive: Sequence[int]) -> bytes:
    """A digest of the round parameters and ``U1``, the part of a view all owners share."""
    packed = struct.pack(f"<I{len(alive)}I", len(alive), *alive)
    return hashlib.sha256(_DOMAIN + params.digest() + packed).digest()


def commitment(round_view: bytes, owner: int, entries: Mapping[int, bytes]) -> bytes:
    """What ``owner`` seals into its shares (R0): the :func:`view` and ``R(owner)``'s keys.

    ``entries`` maps each member of ``R(owner)`` to its :func:`entry`.
    """
    h = hashlib.sha256(round_view + struct.pack("<I", owner))
    for site in sorted(entries):
        h.update(entries[site])
    return h.digest()


def check_survivor_set(
    site: int,
    params: RoundParams,
    graph: Mapping[int, frozenset[int]],
    senders: Iterable[int],
    survivors: Sequence[int],
) -> None:
    """R1: whether ``site`` may sign ``survivors`` (U3); raises SecAggError naming why not."""
    where = f"site {site}, {describe(params.round_id)}"
    if list(survivors) != sorted(set(survivors)) or not set(survivors) <= set(graph):
        raise SecAggError(
            f"{where}: the survivor set is not a sorted subset of the sites that advertised keys"
        )
    if site not in survivors:
        raise SecAggError(f"{where}: the survivor set leaves me out, though my input was sent")
    missing = sorted((graph[site] & set(survivors)) - set(senders))
    if missing:
        raise SecAggError(
            f"{where}: the survivor set includes my neighbours {missing}, whose shares never "
            "reached me (so our pair masks cannot cancel); refusing to sign it"
        )
    floor = max(params.t, params.dp_min_survivors, params.min_included)
    if len(survivors) < floor:
        raise SecAggError(
            f"{where}: the survivor set has {len(survivors)} sites, fewer than "
            f"{floor} (t={params.t}, distributed-DP minimum {params.dp_min_survivors}, the "
            f"round's minimum {params.min_included}); refusing to help unmask so small a sum"
        )
    parts = components(survivors, graph)
    if len(parts) > 1:
        raise SecAggError(
            f"{where}: the survivor set falls apart into {len(parts)} groups with no pair "
            f"mask between them (sizes {sorted(len(p) for p in parts)}); unmasking it would "
            "reveal each group's sum; refusing to sign it"
        )


def check_reveal(
    *,
    site: int,
    params: RoundParams,
    graph: Mapping[int, frozenset[int]],
    survivors: Sequence[int],
    held: Iterable[int],
    commitments: Mapping[int, bytes],
    known: Mapping[int, tuple[AdvertiseKeys, VerifiedPeer]],
    forwarded: Sequence[AdvertiseKeys],
    signatures: Mapping[int, bytes],
    attestations: Mapping[int, tuple[bytes, bytes]],
    verifier: Verifier,
) -> None:
    """R3 for every owner in ``held``; raises SecAggError naming the owner and the fault.

    ``known``: this site's and its neighbours' advertisements, verified when they came.
    ``forwarded``: the others the server sent with the request. Their signatures are
    not checked again: the owner's commitment pins them to the ones the owner checked
    (and if the owner is dishonest, its secrets are not ours to protect).
    ``attestations``: neighbour -> (the key we share, its MAC of its statement), checked
    before its signature. Attestations are checked lazily, neighbours first, each at
    most once, until ``t`` per owner.
    """
    where = f"site {site}, {describe(params.round_id)}"
    extra: dict[int, AdvertiseKeys] = {}
    for advert in forwarded:
        if advert.site in extra:
            raise SecAggError(
                f"{where}: the server forwarded two advertisements of site {advert.site}"
            )
        if advert.site not in known:
            extra[advert.site] = advert
    round_view = view(params, sorted(graph))
    entries: dict[int, bytes] = {}  # site -> entry() of the advertisement used for it
    peers: dict[int, VerifiedPeer] = {s: peer for s, (_, peer) in known.items()}
    valid: dict[int, bool] = {site: True}  # my own statement is U3 itself
    for owner in sorted(held):
        group = sorted(holders(owner, graph), key=lambda s: (s not in known, s))
        adverts = {}
        for s in group:
            advert = known[s][0] if s in known else extra.get(s)
            if advert is None:
                raise SecAggError(
                    f"{where}: the server did not send the keys of site {s}, a share holder of "
                    f"site {owner}; refusing to reveal"
                )
            adverts[s] = advert
            if s not in entries:
                entries[s] = entry(advert)
        if commitment(round_view, owner, {s: entries[s] for s in group}) != commitments.get(owner):
            raise SecAggError(
                f"{where}: site {owner} sealed its shares for a different view of the round "
                "(parameters, advertised sites or its share holders' keys) than the one the "
                "server shows me; the server told sites different stories, refusing to reveal"
            )
        names = []
        for s in group:
            if s not in peers:
                peers[s] = verifier.verify(s, adverts[s].credential)
            names.append(peers[s].name)
        if len(set(names)) != len(names):
            raise SecAggError(
                f"{where}: the share holders of site {owner} are not distinct sites "
                f"({sorted(names)}); refusing to reveal"
            )
        count = 0
        for s in group:
            if s not in valid:
                a = adverts[s]
                statement = survivors_statement(
                    params.round_id, s, a.enc_key, a.mask_key, survivors
                )
                key, mac = attestations.get(s, (b"", b""))
                by_mac = bool(key) and crypto.attested(key, statement, mac)
                valid[s] = by_mac or peers[s].signed(signatures.get(s, b""), statement)
            count += valid[s]
            if count >= params.t:
                break
        else:
            raise SecAggError(
                f"{where}: only {count} of site {owner}'s {len(group)} share holders signed "
                f"the survivor set I signed, fewer than t={params.t}; the server may have told "
                "them a different one, refusing to reveal any share"
            )
