"""A server that lies about who dropped out, against the consistency check.

The server runs stages 0-2 honestly (it needs the masked inputs), then tells the share
holders of a victim different survivor sets: some hear the victim survived (they
reveal seed shares of its self mask), the others that its neighbours dropped (they
reveal their mask keys, from which the pair masks on the victim's input follow).
Without the check that recovers the victim's exact update; with it, every holder
that would give the server the second half refuses.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from fedtrain.errors import SecAggError
from fedtrain.secagg import (
    AdvertiseKeys,
    ConsistencyRequest,
    ConsistencySignature,
    InMemoryPKI,
    KeysBroadcast,
    MaskedInput,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    Stage,
    UnmaskRequest,
    UnmaskShares,
    crypto,
    neighbour_graph,
    run_in_memory,
    shamir,
)
from fedtrain.secagg.identity import SigningIdentity, advertisement_statement

N, K, T = 40, 8, 5  # the review's case: 9 share holders, threshold 5
M = 64
ROUND = 77
GRAPH_SEED = bytes(range(32))


@dataclass
class Round:
    """A round driven by hand through stage 2, with what a server would have recorded."""

    check: bool
    server: SecAggServer = field(init=False)
    clients: dict[int, SecAggClient] = field(init=False)
    inputs: dict[int, tuple[np.ndarray, float]] = field(init=False)
    identities: dict[int, SigningIdentity] = field(init=False)
    adverts: dict[int, AdvertiseKeys] = field(default_factory=dict)
    masked: dict[int, MaskedInput] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = SecAggConfig(
            clip=1.0, max_clients=64, max_weight=100.0, k=K, t=T, consistency_check=self.check
        )
        self.sites = list(range(1, N + 1))
        self.graph = neighbour_graph(self.sites, K, GRAPH_SEED)
        self.quantizer = config.quantizer()
        pki = InMemoryPKI()
        self.server = SecAggServer.from_config(config, ROUND, self.sites, M, GRAPH_SEED)
        self.identities = {s: pki.enrol(f"site-{s}") for s in self.sites}
        self.clients = {
            s: SecAggClient(
                s, rng=np.random.default_rng(s), identity=self.identities[s], verifier=pki
            )
            for s in self.sites
        }
        rng = np.random.default_rng(0)
        self.inputs = {s: (rng.normal(0, 0.3, M), float(rng.integers(1, 100))) for s in self.sites}
        for s, (x, w) in self.inputs.items():
            self.clients[s].set_input(x, w)

    def to_masked_input(self, tamper: Callable[[int, object], object] | None = None) -> None:
        """Stages 0-2, honestly (``tamper`` may rewrite a server message on its way)."""
        out = self.server.start()
        for stage in range(3):
            for s, msg in sorted(out.items()):
                if tamper is not None:
                    msg = tamper(s, msg)
                reply = self.clients[s].handle(msg)
                if isinstance(reply, AdvertiseKeys):
                    self.adverts[s] = reply
                if isinstance(reply, MaskedInput):
                    self.masked[s] = reply
                self.server.receive(reply)
            if stage < 2:
                out = self.server.advance()

    def held(self, w: int) -> frozenset[int]:
        return self.graph[w] | {w}

    def encoded(self, site: int) -> np.ndarray:
        """The site's quantized input, as its client encoded it (same rng seed)."""
        x, w = self.inputs[site]
        return self.quantizer.encode(x, w, np.random.default_rng(site))


def _stories(r: Round, victim: int) -> dict[int, frozenset[int]]:
    """Which of its share owners each holder is told survived, for the attack.

    Everyone hears the victim survived; its neighbours J dropped, except the holder
    itself and, where a holder would otherwise see fewer than t survivors and refuse,
    the J members with the most other holders already telling them dropped.
    """
    J = r.graph[victim]
    stories = {}
    told = dict.fromkeys(J, 0)  # j -> holders told j dropped
    holders = sorted(w for w in r.sites if r.held(w) & (J | {victim}))
    for w in holders:
        stories[w] = set(r.held(w) - (J - {w}))
        for j in r.held(w) & J - stories[w]:
            told[j] += 1
    for w in holders:
        while len(stories[w]) < T:
            back = max(r.held(w) & J - stories[w], key=lambda j: (told[j], j))
            stories[w].add(back)
            told[back] -= 1
    assert all(n >= T for n in told.values()), told  # the attack is feasible here
    assert sum(victim in s for s in stories.values()) >= T
    return {w: frozenset(s) for w, s in stories.items()}


def _request(
    r: Round, site: int, u3: frozenset[int], signatures: dict[int, bytes]
) -> UnmaskRequest:
    """The unmask request a liar sends ``site`` for its story ``u3``: consistent with it,
    with every signature and every advertisement the site lacks forwarded."""
    held = r.held(site)
    return UnmaskRequest(
        ROUND,
        site,
        tuple(sorted(held & u3)),
        tuple(sorted(held - u3)),
        tuple(sorted(signatures.items())),
        tuple(r.adverts[s] for s in sorted(r.adverts) if s not in held),
    )


def _recover(r: Round, victim: int, shares: list[UnmaskShares]) -> np.ndarray | None:
    """The victim's encoded input from its masked one, if the shares allow it."""
    seeds: dict[int, list[shamir.Share]] = {}
    keys: dict[int, list[shamir.Share]] = {}
    for reply in shares:
        for owner, raw in reply.seed_shares:
            seeds.setdefault(owner, []).append(shamir.Share.from_bytes(raw))
        for owner, raw in reply.key_shares:
            keys.setdefault(owner, []).append(shamir.Share.from_bytes(raw))
    for owner in set(seeds) & set(keys):  # never both secrets of one site
        assert min(len(seeds[owner]), len(keys[owner])) < T, owner
    J = r.graph[victim]
    if len(seeds.get(victim, [])) < T or any(len(keys.get(j, [])) < T for j in J):
        return None
    y = r.masked[victim].vector.copy()
    expander = crypto.MaskExpander()
    expander.apply(y, shamir.combine(seeds[victim]), -1)
    for j in J:
        s_j = crypto.KeyPair.from_private_bytes(shamir.combine(keys[j]))
        seed = crypto.pair_mask_seed(s_j.exchange(r.adverts[victim].mask_key), ROUND, victim, j)
        expander.apply(y, seed, -1 if victim < j else 1)
    return y


def _attack(r: Round, victim: int) -> tuple[np.ndarray | None, dict[int, str]]:
    """Lie to the victim's holders; returns (recovered input or None, refusals by site)."""
    stories = _stories(r, victim)
    refusals: dict[int, str] = {}
    survivor_sets = {w: frozenset(r.sites) - r.held(w) | s for w, s in stories.items()}
    signatures: dict[int, bytes] = {}
    if r.check:
        for w, u3 in sorted(survivor_sets.items()):
            try:
                reply = r.clients[w].handle(ConsistencyRequest(ROUND, w, tuple(sorted(u3))))
            except SecAggError as exc:
                refusals[w] = str(exc)
                continue
            assert isinstance(reply, ConsistencySignature)
            signatures[w] = reply.signature
    shares = []
    for w, story in sorted(stories.items()):
        if w in refusals:
            continue
        try:
            reply = r.clients[w].handle(_request(r, w, story, signatures))
        except SecAggError as exc:
            refusals[w] = str(exc)
            continue
        assert isinstance(reply, UnmaskShares)
        shares.append(reply)
    return _recover(r, victim, shares), refusals


def test_without_the_check_a_lying_server_recovers_one_site_exactly() -> None:
    r = Round(check=False)
    r.to_masked_input()
    victim = r.sites[7]
    recovered, refusals = _attack(r, victim)
    assert refusals == {}  # every holder's request looked fine on its own
    assert recovered is not None
    assert np.array_equal(recovered, r.encoded(victim))
    x, w = r.inputs[victim]
    assert recovered[-1] * r.quantizer.weight_resolution == w  # its weight, too
    decoded, _ = r.quantizer.decode_sum(recovered, 1)
    assert np.abs(decoded / w - np.clip(x, -1, 1)).max() <= r.quantizer.step / w  # its update


def test_with_the_check_the_same_lies_get_nothing() -> None:
    r = Round(check=True)
    r.to_masked_input()
    victim = r.sites[7]
    recovered, refusals = _attack(r, victim)
    assert recovered is None
    # Every holder lied to refuses, naming itself, the round and the owner short of
    # signatures: fewer than t of that owner's holders signed the set it was told.
    assert set(refusals) == set(_stories(r, victim))
    for w, message in refusals.items():
        assert message.startswith(f"site {w}, round {ROUND}: only 1 of site ")
        assert "share holders signed the survivor set I signed, fewer than t=5" in message


def test_holders_split_between_two_survivor_sets_cannot_both_reveal() -> None:
    """t holders hear the victim survived, the other k + 1 - t that it dropped."""
    r = Round(check=True)
    r.to_masked_input()
    victim = r.sites[3]
    holders = sorted(r.held(victim))
    told_dropped = set(holders[T:])  # 4 of 9
    everyone = tuple(r.sites)
    without = tuple(s for s in r.sites if s != victim)
    signatures = {}
    for s in r.sites:
        u3 = without if s in told_dropped else everyone
        reply = r.clients[s].handle(ConsistencyRequest(ROUND, s, u3))
        signatures[s] = reply.signature
    revealed = {"seed": 0, "key": 0}
    for s in holders:
        request = _request(r, s, frozenset(without if s in told_dropped else everyone), signatures)
        if s in told_dropped:
            # (It names the first owner short of signatures; the victim has 4 of 9.)
            with pytest.raises(
                SecAggError,
                match=rf"site {s}, round {ROUND}: only \d of site \d+'s 9 share holders "
                "signed the survivor set I signed, fewer than t=5",
            ):
                r.clients[s].handle(request)
        else:
            reply = r.clients[s].handle(request)
            revealed["seed"] += any(o == victim for o, _ in reply.seed_shares)
            revealed["key"] += any(o == victim for o, _ in reply.key_shares)
    assert revealed == {"seed": T, "key": 0}


def _signed_round() -> tuple[Round, dict[int, UnmaskRequest]]:
    """An honest round up to the unmask requests (the server's own)."""
    r = Round(check=True)
    r.to_masked_input()
    out = r.server.advance()
    for s, msg in sorted(out.items()):
        r.server.receive(r.clients[s].handle(msg))
    requests = r.server.advance()
    assert r.server.stage == Stage.UNMASK
    return r, requests  # type: ignore[return-value]


def test_unmask_request_must_follow_the_signed_survivor_set() -> None:
    r, requests = _signed_round()
    site = r.sites[0]
    req = requests[site]
    owner = next(o for o in req.survivors if o != site)
    flipped = dataclasses.replace(
        req,
        survivors=tuple(o for o in req.survivors if o != owner),
        dropped=tuple(sorted((*req.dropped, owner))),
    )
    with pytest.raises(SecAggError, match="contradicts the survivor set I signed"):
        r.clients[site].handle(flipped)


def test_forwarded_keys_must_match_what_the_owner_sealed_into_its_shares() -> None:
    r, requests = _signed_round()
    site = r.sites[1]
    req = requests[site]
    assert req.keys  # its owners' holders beyond its own neighbours
    altered = dataclasses.replace(req.keys[0], mask_key=crypto.KeyPair.generate().public)
    with pytest.raises(SecAggError, match="sealed its shares for a different view"):
        r.clients[site].handle(dataclasses.replace(req, keys=(altered, *req.keys[1:])))
    site = r.sites[2]
    req = requests[site]
    with pytest.raises(SecAggError, match=r"did not send the keys of site \d+, a share holder"):
        r.clients[site].handle(dataclasses.replace(req, keys=req.keys[1:]))


def test_neighbours_attest_by_mac_and_others_by_signature() -> None:
    r, requests = _signed_round()

    def forged(site: int) -> tuple[tuple[int, bytes], ...]:  # its own signature, for all
        mine = dict(requests[site].signatures)[site]
        return tuple((s, mine) for s, _ in requests[site].signatures)

    def wrong(site: int) -> tuple[tuple[int, bytes], ...]:
        return tuple((s, bytes(32)) for s, _ in requests[site].macs)

    a, b, c, d, e = r.sites[4:9]
    assert {s for s, _ in requests[a].macs} == r.graph[a]  # every neighbour signed U3
    for site, bad in (
        (a, {"signatures": forged(a), "macs": ()}),
        (b, {"signatures": forged(b), "macs": wrong(b)}),
        (c, {"signatures": (), "macs": wrong(c)}),
    ):
        with pytest.raises(SecAggError, match="fewer than t=5"):
            r.clients[site].handle(dataclasses.replace(requests[site], **bad))
    # MACs alone, or signatures alone, are enough.
    assert r.clients[d].handle(dataclasses.replace(requests[d], signatures=()))
    assert r.clients[e].handle(dataclasses.replace(requests[e], macs=()))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda site, u3: tuple(s for s in u3 if s != site), "leaves me out"),
        (lambda site, u3: tuple(reversed(u3)), "not a sorted subset"),
        (lambda site, u3: (*u3, N + 5), "not a sorted subset"),
        (lambda site, u3: u3[:3] if site in u3[:3] else (*u3[:2], site), "fewer than 5"),
    ],
)
def test_a_site_signs_only_a_survivor_set_it_can_stand_behind(change, match) -> None:
    r = Round(check=True)
    r.to_masked_input()
    site = r.sites[5]
    u3 = tuple(r.sites)
    with pytest.raises(SecAggError, match=match):
        r.clients[site].handle(ConsistencyRequest(ROUND, site, change(site, u3)))


def test_a_site_signs_one_survivor_set_per_round() -> None:
    r = Round(check=True)
    r.to_masked_input()
    site = r.sites[5]
    r.clients[site].handle(ConsistencyRequest(ROUND, site, tuple(r.sites)))
    others = tuple(s for s in r.sites if s != r.sites[0])
    with pytest.raises(SecAggError, match="got ConsistencyRequest in stage UNMASK"):
        r.clients[site].handle(ConsistencyRequest(ROUND, site, others))


def test_a_survivor_set_in_two_pieces_is_not_signed() -> None:
    r = Round(check=True)
    r.to_masked_input()
    # The graph is a ring in this order, each site joined to the K/2 on either side
    # (fedtrain.secagg.graph): two runs of K/2 missing sites cut it in two.
    ring = sorted(
        r.sites, key=lambda s: hashlib.sha256(GRAPH_SEED + s.to_bytes(8, "little")).digest()
    )
    assert all(r.graph[ring[i]] >= {ring[i - 1], ring[(i + 1) % N]} for i in range(N))
    cut = {ring[i] for i in (*range(10, 10 + K // 2), *range(30, 30 + K // 2))}
    site = ring[0]
    u3 = tuple(s for s in r.sites if s not in cut)
    with pytest.raises(SecAggError, match=r"falls apart into 2 groups .*sizes \[16, 16\]"):
        r.clients[site].handle(ConsistencyRequest(ROUND, site, u3))


def test_forged_neighbour_keys_are_refused() -> None:
    def forge(site: int, msg: object) -> object:
        if isinstance(msg, KeysBroadcast) and site == 1:
            fake = crypto.KeyPair.generate()
            first = dataclasses.replace(msg.keys[0], enc_key=fake.public)
            return dataclasses.replace(msg, keys=(first, *msg.keys[1:]))
        return msg

    r = Round(check=True)
    with pytest.raises(SecAggError, match="are not signed by its certified key"):
        r.to_masked_input(forge)


def test_one_site_cannot_fill_two_neighbour_slots() -> None:
    """A colluding neighbour signs fresh keys for another neighbour's id: it verifies,
    but the same certified name would hold two of site 1's share-holder slots."""
    r = Round(check=True)

    def sybil(site: int, msg: object) -> object:
        if isinstance(msg, KeysBroadcast) and site == 1:
            a, b = msg.keys[0], msg.keys[1]
            enc, mask = crypto.KeyPair.generate().public, crypto.KeyPair.generate().public
            colluder = r.identities[b.site]
            signature = colluder.sign(advertisement_statement(ROUND, a.site, enc, mask))
            twin = AdvertiseKeys(ROUND, a.site, enc, mask, colluder.credential, signature)
            return dataclasses.replace(msg, keys=(twin, *msg.keys[1:]))
        return msg

    with pytest.raises(SecAggError, match=r"my neighbours are not distinct sites .*'site-\d+'"):
        r.to_masked_input(sybil)


def test_server_drops_a_site_whose_advertisement_is_not_signed() -> None:
    pki = InMemoryPKI()
    config = SecAggConfig(max_clients=16, max_weight=10.0, k=4)
    server = SecAggServer.from_config(config, 1, range(1, 7), 8, GRAPH_SEED, verifier=pki)
    client = SecAggClient(1, identity=pki.enrol("site-1"), verifier=pki)
    advert = client.handle(server.start()[1])
    with pytest.raises(SecAggError, match="advertised keys its certified key did not sign"):
        server.receive(dataclasses.replace(advert, mask_key=crypto.KeyPair.generate().public))
    with pytest.raises(SecAggError, match="not enrolled"):
        server.receive(dataclasses.replace(advert, credential=b"\x05\x00site-1" + bytes(32)))
    assert 1 in server.pending
    server.receive(advert)
    assert 1 not in server.pending


def test_a_site_requiring_the_check_refuses_a_round_without_it() -> None:
    pki = InMemoryPKI()
    config = SecAggConfig(max_clients=16, max_weight=10.0, k=4, consistency_check=False)
    server = SecAggServer.from_config(config, 1, range(1, 7), 8, GRAPH_SEED)
    client = SecAggClient(
        1, identity=pki.enrol("site-1"), verifier=pki, require_consistency_check=True
    )
    with pytest.raises(SecAggError, match="does not run the consistency check"):
        client.handle(server.start()[1])
    on = SecAggServer.from_config(
        dataclasses.replace(config, consistency_check=True), 1, range(1, 7), 8
    )
    with pytest.raises(SecAggError, match="no signing identity"):
        SecAggClient(1).handle(on.start()[1])


@pytest.mark.parametrize("check", [True, False])
def test_honest_rounds_with_identities_are_exact(check: bool) -> None:
    rng = np.random.default_rng(5)
    xs = [rng.normal(0, 0.3, M) for _ in range(N)]
    ws = [float(w) for w in rng.integers(1, 100, N)]
    config = SecAggConfig(
        clip=1.0, max_clients=64, max_weight=100.0, k=K, t=T, consistency_check=check
    )
    result = run_in_memory(
        xs,
        ws,
        config,
        {3: [4], 4: [9]},
        rng=1,
        graph_seed=GRAPH_SEED,
        through_bytes=True,
        pki=InMemoryPKI(),
    )
    assert result.included == tuple(range(1, N + 1))
    q = config.quantizer()
    rngs = np.random.default_rng(1).spawn(N)
    want = sum(q.encode(x, w, g).astype(np.uint64) for x, w, g in zip(xs, ws, rngs, strict=True))
    assert np.array_equal(result.total, want.astype(np.uint32))
