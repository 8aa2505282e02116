"""SecAgg+ as two pure state machines: :class:`SecAggClient` and :class:`SecAggServer`.

Messages in, messages out; no I/O, threads or clocks. A driver (the gRPC runtime, the
simulation, :func:`~fedtrain.secagg.inmemory.run_in_memory`) moves the messages and
decides when a stage ends (all expected replies arrived, or a deadline passed); the
sites that did not reply by then are dropouts. Sets of sites, as in Bonawitz et al.:

* ``U1``: advertised keys (stage 0). The neighbour graph is built over ``U1``, so a
  site that never shows up costs nobody a neighbour.
* ``U2``: shared their secrets (stage 1), pruned so every member keeps >= t - 1
  neighbours in ``U2`` (else its self-mask could never be removed).
* ``U3``: delivered a complete masked input (stage 2); these are the *included* sites.
  It must be connected in the graph (else each part's sum would be unmasked alone).
* With the consistency check (stage 3, ``RoundParams.consistency_check``): the sites of
  ``U3`` that signed ``U3``; only they are asked to reveal, and each reveals only under
  the rule of `fedtrain.secagg.consistency`.
* ``U4``: revealed shares (stage 4). Each site in ``U3`` needs ``t`` seed shares from
  ``U4``; each site in ``U2 - U3`` with a neighbour in ``U3`` needs ``t`` mask-key shares.

With site identities (`fedtrain.secagg.identity`) every advertisement is signed and
every site checks its neighbours' signatures before it encrypts a share to them.

Masked input of site ``i``: ``y_i = enc(x_i, w_i) + PRG(b_i) + sum_j sign(i, j) PRG(s_ij)``
over its neighbours ``j`` in ``U2``, ``sign = +1 if i < j else -1``; pairwise masks of
two included neighbours cancel in the sum, the rest the server removes from the
reconstructed secrets.
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from fedtrain.errors import SecAggError
from fedtrain.secagg import consistency, crypto, shamir
from fedtrain.secagg.aggregator import ModularSumAggregator
from fedtrain.secagg.config import MAX_SITE_ID, SecAggConfig
from fedtrain.secagg.graph import (
    GRAPH_SEED_BYTES,
    check_threshold,
    components,
    effective_degree,
    neighbour_graph,
)
from fedtrain.secagg.identity import (
    Identity,
    VerifiedPeer,
    Verifier,
    advertisement_statement,
    survivors_statement,
)
from fedtrain.secagg.messages import (
    AdvertiseKeys,
    ClientMessage,
    ConsistencyRequest,
    ConsistencySignature,
    KeysBroadcast,
    MaskedInput,
    RoundParams,
    RoutedShares,
    ServerMessage,
    SetupRequest,
    ShareKeys,
    UnmaskRequest,
    UnmaskShares,
)
from fedtrain.secagg.quantize import Quantizer
from fedtrain.secagg.round_ids import describe

logger = logging.getLogger(__name__)

_PAIR = struct.Struct("<II")
# sender, receiver, the sender's commitment to its view (consistency R0), two shares
_SHARES_PLAINTEXT = _PAIR.size + consistency.COMMITMENT_BYTES + 2 * shamir.SHARE_BYTES
_MAX_CIPHERTEXT = crypto.NONCE_BYTES + _SHARES_PLAINTEXT + 16


class Stage(enum.IntEnum):
    """Where a client or server is; the value is the stage whose replies it awaits."""

    SETUP = 0
    SHARE_KEYS = 1
    MASKED_INPUT = 2
    CONSISTENCY = 3
    UNMASK = 4
    DONE = 5
    FAILED = 6


def validate_params(params: RoundParams) -> Quantizer:
    """Checks every site (and the server) runs on the round's public parameters."""
    sites = params.sites
    if len(sites) < 2:
        raise SecAggError(f"{describe(params.round_id)}: needs at least 2 sites, got {len(sites)}")
    if list(sites) != sorted(set(sites)) or sites[0] < 1 or sites[-1] > MAX_SITE_ID:
        raise SecAggError(
            f"{describe(params.round_id)}: site ids must be sorted, distinct, in [1, 2^32 - 1]"
        )
    quantizer = params.quantizer()
    if len(sites) > quantizer.max_clients:
        raise SecAggError(
            f"{describe(params.round_id)}: {len(sites)} sites exceed max_clients="
            f"{quantizer.max_clients}; the sum could wrap"
        )
    if params.vector_length < 1:
        raise SecAggError(f"{describe(params.round_id)}: vector_length must be >= 1")
    if len(params.graph_seed) != GRAPH_SEED_BYTES:
        raise SecAggError(
            f"{describe(params.round_id)}: graph seed must be {GRAPH_SEED_BYTES} bytes"
        )
    check_threshold(params.t, params.k, len(sites))
    if params.min_included > len(sites):
        raise SecAggError(
            f"{describe(params.round_id)}: min_included = {params.min_included} exceeds the "
            f"round's {len(sites)} sites"
        )
    return quantizer


def _sign(i: int, j: int) -> int:
    return 1 if i < j else -1


@dataclass(frozen=True)
class SecAggResult:
    """The unmasked modular sum over the included sites, and how to decode it.

    ``total`` has ``vector_length + 1`` uint32 elements: the sum of encoded weighted
    updates, then the sum of encoded weights.
    """

    round_id: int
    total: np.ndarray
    included: tuple[int, ...]
    dropped: tuple[int, ...]
    quantizer: Quantizer

    def weighted_sum(self) -> tuple[np.ndarray, float]:
        """``(sum_i w'_i * clip(x_i), sum_i w'_i)`` over the included sites."""
        return self.quantizer.decode_sum(self.total, len(self.included))

    def weighted_mean(self) -> np.ndarray:
        """``sum_i w'_i x_i / sum_i w'_i`` (float64), within the documented bound."""
        return self.quantizer.decode_mean(self.total, len(self.included))

    @property
    def total_weight(self) -> float:
        return int(self.total[-1]) * self.quantizer.weight_resolution


#: Adds privacy noise in place to a site's encoded update (uint32, weight last) before
#: it is masked, e.g. `fedtrain.privacy.distributed.DistributedDP.add_noise`.
EncodedNoise = Callable[[np.ndarray, Quantizer], None]


class SecAggClient:
    """One site's side of one round. Create a new one every round (fresh keys).

    Call :meth:`set_input` (any time before the masked-input stage) and feed every
    server message to :meth:`handle`, which returns the reply. Any SecAggError puts
    the client in ``FAILED``: it answers nothing more this round. ``noise``, if given,
    noises the quantized update before masking (distributed DP).

    ``identity`` and ``verifier`` (together, or neither) bind keys to sites: the client
    signs its advertisement and refuses neighbours whose keys are not signed by a
    verified identity. A round with the consistency check needs them; with
    ``require_consistency_check`` the client also refuses a round without it (a server
    could simply switch it off).
    """

    def __init__(
        self,
        site: int,
        rng: np.random.Generator | None = None,
        expander: crypto.MaskExpander | None = None,
        noise: EncodedNoise | None = None,
        *,
        identity: Identity | None = None,
        verifier: Verifier | None = None,
        require_consistency_check: bool = False,
    ) -> None:
        if not (1 <= site <= MAX_SITE_ID):
            raise SecAggError(f"site id must be in [1, 2^32 - 1], got {site}")
        if (identity is None) != (verifier is None):
            raise SecAggError(f"site {site}: give both an identity and a verifier, or neither")
        self.site = site
        self._rng = rng if rng is not None else np.random.default_rng()
        self._expander = expander if expander is not None else crypto.MaskExpander()
        self._noise = noise
        self._identity = identity
        self._verifier = verifier
        self._require_check = require_consistency_check
        self._stage = Stage.SETUP
        self._params: RoundParams | None = None
        self._quantizer: Quantizer | None = None
        self._update: np.ndarray | None = None
        self._weight: float | None = None
        self._enc: crypto.KeyPair | None = None
        self._mask: crypto.KeyPair | None = None
        self._seed: bytes | None = None
        self._alive: tuple[int, ...] = ()
        # me and my neighbours: advertisement, and its verified identity (if any)
        self._known: dict[int, tuple[AdvertiseKeys, VerifiedPeer | None]] = {}
        # neighbour -> AES-GCM key of the shares between us (one key both ways)
        self._pair_keys: dict[int, bytes] = {}
        # neighbour -> HMAC key of our attestations to each other (consistency check)
        self._attest_keys: dict[int, bytes] = {}
        # owner -> (seed share, mask-key share) that this site holds (itself included)
        self._held: dict[int, tuple[shamir.Share, shamir.Share]] = {}
        # owner -> the commitment it sealed into its shares (consistency R0)
        self._commitments: dict[int, bytes] = {}
        self._signed: tuple[int, ...] | None = None  # the survivor set this site signed

    @property
    def stage(self) -> Stage:
        return self._stage

    def set_input(self, update: np.ndarray, weight: float) -> None:
        """The float update (any shape, flattened) and its weight (e.g. example count)."""
        if self._stage > Stage.MASKED_INPUT:
            raise SecAggError(f"site {self.site}: input set after the masked-input stage")
        self._update = np.asarray(update)
        self._weight = float(weight)

    def handle(self, msg: ServerMessage) -> ClientMessage:
        """Process one server message and return the reply to send back."""
        if self._stage in (Stage.DONE, Stage.FAILED):
            raise SecAggError(
                f"site {self.site}: round is over ({self._stage.name}); refusing "
                f"{type(msg).__name__} (a second unmask request could reveal both secrets)"
            )
        try:
            if isinstance(msg, SetupRequest):
                return self._setup(msg)
            if isinstance(msg, KeysBroadcast):
                return self._share_keys(msg)
            if isinstance(msg, RoutedShares):
                return self._masked_input(msg)
            if isinstance(msg, ConsistencyRequest):
                return self._consistency(msg)
            if isinstance(msg, UnmaskRequest):
                return self._unmask(msg)
            raise SecAggError(f"site {self.site}: unexpected message {type(msg).__name__}")
        except SecAggError:
            self._stage = Stage.FAILED
            self._forget()
            raise

    def _forget(self) -> None:
        self._update = None
        self._seed = None
        self._enc = None
        self._mask = None
        self._pair_keys.clear()
        self._attest_keys.clear()
        self._held.clear()

    def _expect(self, stage: Stage, msg: ServerMessage, round_id: int, site: int) -> RoundParams:
        if self._stage != stage:
            raise SecAggError(
                f"site {self.site}: got {type(msg).__name__} in stage {self._stage.name}"
            )
        if site != self.site:
            raise SecAggError(f"site {self.site}: got a message addressed to site {site}")
        params = self._params
        if params is None:  # pragma: no cover - guarded by the stage check
            raise SecAggError(f"site {self.site}: no round parameters")
        if round_id != params.round_id:
            raise SecAggError(
                f"site {self.site}: message for {describe(round_id)} during "
                f"{describe(params.round_id)}"
            )
        return params

    # -- stage 0 -------------------------------------------------------------------
    def _setup(self, msg: SetupRequest) -> AdvertiseKeys:
        if self._stage != Stage.SETUP:
            raise SecAggError(f"site {self.site}: got SetupRequest in stage {self._stage.name}")
        if msg.site != self.site:
            raise SecAggError(f"site {self.site}: got a SetupRequest for site {msg.site}")
        params = msg.params
        where = f"site {self.site}, {describe(params.round_id)}"
        self._quantizer = validate_params(params)
        if self.site not in params.sites:
            raise SecAggError(f"site {self.site} is not among the round's sites")
        if params.consistency_check and self._identity is None:
            raise SecAggError(
                f"{where}: the round runs the consistency check, but this site has no signing "
                "identity (a site certificate) to take part in it"
            )
        if not params.consistency_check and self._require_check:
            raise SecAggError(
                f"{where}: the server does not run the consistency check, so it could learn "
                "one site's update by telling sites different survivor sets; this site "
                "requires it (the server must set secagg.consistency_check = true)"
            )
        self._params = params
        self._enc = crypto.KeyPair.generate()
        self._mask = crypto.KeyPair.generate()
        advert = AdvertiseKeys(params.round_id, self.site, self._enc.public, self._mask.public)
        me: VerifiedPeer | None = None
        if self._identity is not None and self._verifier is not None:
            statement = advertisement_statement(
                params.round_id, self.site, advert.enc_key, advert.mask_key
            )
            credential = self._identity.credential
            advert = AdvertiseKeys(
                advert.round_id,
                advert.site,
                advert.enc_key,
                advert.mask_key,
                credential,
                self._identity.sign(statement),
            )
            me = self._verifier.verify(self.site, credential)  # my own must verify too
        self._known[self.site] = (advert, me)
        self._stage = Stage.SHARE_KEYS
        return advert

    def _check_advert(self, params: RoundParams, advert: AdvertiseKeys) -> VerifiedPeer | None:
        """A neighbour's advertisement is signed by a verified identity (None: no identities)."""
        if self._verifier is None:
            return None
        where = f"site {self.site}, {describe(params.round_id)}"
        try:
            peer = self._verifier.verify(advert.site, advert.credential)
        except SecAggError as exc:
            raise SecAggError(
                f"{where}: the identity of neighbour {advert.site} does not verify ({exc}); "
                "refusing to share keys with it"
            ) from None
        statement = advertisement_statement(
            params.round_id, advert.site, advert.enc_key, advert.mask_key
        )
        if not peer.signed(advert.signature, statement):
            raise SecAggError(
                f"{where}: the public keys of neighbour {advert.site} ({peer.name!r}) are not "
                "signed by its certified key: forged or altered (by the server?); refusing to "
                "share keys with it"
            )
        return peer

    # -- stage 1 -------------------------------------------------------------------
    def _share_keys(self, msg: KeysBroadcast) -> ShareKeys:
        params = self._expect(Stage.SHARE_KEYS, msg, msg.round_id, msg.site)
        alive = msg.sites
        if list(alive) != sorted(set(alive)) or not set(alive) <= set(params.sites):
            raise SecAggError(
                f"site {self.site}: the advertised-site list is not a sorted subset of the round"
            )
        if self.site not in alive:
            raise SecAggError(f"site {self.site}: left out of the sites that advertised keys")
        check_threshold(params.t, params.k, len(alive))
        neighbours = neighbour_graph(alive, params.k, params.graph_seed)[self.site]
        keys = {k.site: k for k in msg.keys}
        if len(keys) != len(msg.keys) or set(keys) != neighbours:
            raise SecAggError(
                f"site {self.site}: server sent keys of {sorted(keys)}, but my neighbours "
                f"are {sorted(neighbours)}"
            )
        assert self._enc is not None and self._mask is not None
        publics = [self._enc.public, self._mask.public]
        for k in keys.values():
            if k.round_id != params.round_id:
                raise SecAggError(f"site {self.site}: key of site {k.site} is for another round")
            publics += [k.enc_key, k.mask_key]
        if len(set(publics)) != len(publics):
            raise SecAggError(f"site {self.site}: neighbours' public keys are not all distinct")
        for v in sorted(keys):
            self._known[v] = (keys[v], self._check_advert(params, keys[v]))
        if self._verifier is not None:
            names = [peer.name for _, peer in self._known.values() if peer is not None]
            if len(set(names)) != len(names):
                raise SecAggError(
                    f"site {self.site}, {describe(params.round_id)}: my neighbours are not "
                    f"distinct sites (certified names {sorted(names)}); refusing to share keys"
                )
        self._alive = alive
        sealed = consistency.commitment(
            consistency.view(params, alive),
            self.site,
            {s: consistency.entry(a) for s, (a, _) in self._known.items()},
        )
        self._seed = crypto.new_seed()
        holders = sorted(neighbours | {self.site})
        seed_shares = shamir.split(self._seed, params.t, holders)
        key_shares = shamir.split(self._mask.private_bytes(), params.t, holders)
        self._held[self.site] = (seed_shares[self.site], key_shares[self.site])
        self._commitments[self.site] = sealed
        out = []
        for v in sorted(neighbours):
            plaintext = (
                _PAIR.pack(self.site, v)
                + sealed
                + seed_shares[v].to_bytes()
                + key_shares[v].to_bytes()
            )
            shared = self._enc.exchange(keys[v].enc_key)
            key = crypto.share_key(shared, params.round_id, self.site, v)
            self._pair_keys[v] = key
            if params.consistency_check:
                self._attest_keys[v] = crypto.attestation_key(shared, params.round_id, self.site, v)
            out.append((v, crypto.encrypt_shares(key, plaintext, params.round_id, self.site, v)))
        self._enc = None  # its only use, the share keys, is done
        self._stage = Stage.MASKED_INPUT
        return ShareKeys(params.round_id, self.site, tuple(out))

    # -- stage 2 -------------------------------------------------------------------
    def _masked_input(self, msg: RoutedShares) -> MaskedInput:
        params = self._expect(Stage.MASKED_INPUT, msg, msg.round_id, msg.site)
        assert self._mask is not None and self._seed is not None
        assert self._quantizer is not None
        if self._update is None or self._weight is None:
            raise SecAggError(f"site {self.site}: no input set before the masked-input stage")
        senders = [s for s, _ in msg.ciphertexts]
        neighbours = set(self._known) - {self.site}
        if len(set(senders)) != len(senders) or not set(senders) <= neighbours:
            raise SecAggError(
                f"site {self.site}: routed shares from {sorted(senders)}, which are not "
                f"distinct neighbours {sorted(neighbours)}"
            )
        if len(senders) + 1 < params.t:
            raise SecAggError(
                f"site {self.site}: only {len(senders)} neighbours shared keys; with me that "
                f"is {len(senders) + 1} < t={params.t} holders, so my mask could never be "
                f"removed; abort"
            )
        for sender, ciphertext in msg.ciphertexts:
            key = self._pair_keys[sender]
            plaintext = crypto.decrypt_shares(key, ciphertext, params.round_id, sender, self.site)
            self._commitments[sender], self._held[sender] = self._parse_shares(
                plaintext, sender, params
            )
        update = self._update
        if update.size != params.vector_length:
            raise SecAggError(
                f"site {self.site}: update has {update.size} values, the round expects "
                f"{params.vector_length}"
            )
        y = self._quantizer.encode(update, self._weight, self._rng)
        if self._noise is not None:
            self._noise(y, self._quantizer)
        masks = [(self._seed, 1)]
        for v in senders:
            shared = self._mask.exchange(self._known[v][0].mask_key)
            seed = crypto.pair_mask_seed(shared, params.round_id, self.site, v)
            masks.append((seed, _sign(self.site, v)))
        self._expander.apply_many(y, masks)
        # Secrets no longer needed here live on only as shares.
        self._update = None
        self._seed = None
        self._mask = None
        self._pair_keys.clear()
        self._stage = Stage.CONSISTENCY if params.consistency_check else Stage.UNMASK
        return MaskedInput(params.round_id, self.site, y)

    def _parse_shares(
        self, plaintext: bytes, sender: int, params: RoundParams
    ) -> tuple[bytes, tuple[shamir.Share, shamir.Share]]:
        if len(plaintext) != _SHARES_PLAINTEXT:
            raise SecAggError(f"site {self.site}: malformed shares from site {sender}")
        inner_sender, inner_receiver = _PAIR.unpack_from(plaintext)
        if (inner_sender, inner_receiver) != (sender, self.site):
            raise SecAggError(
                f"site {self.site}: shares from {sender} claim to be {inner_sender}->"
                f"{inner_receiver}"
            )
        a = _PAIR.size + consistency.COMMITMENT_BYTES
        b = a + shamir.SHARE_BYTES
        pair = (
            shamir.Share.from_bytes(plaintext[a:b]),
            shamir.Share.from_bytes(plaintext[b:]),
        )
        for share in pair:
            if (share.x, share.threshold, share.secret_len) != (self.site, params.t, 32):
                raise SecAggError(
                    f"site {self.site}: share from site {sender} has wrong parameters"
                )
        return plaintext[_PAIR.size : a], pair

    # -- stage 3 -------------------------------------------------------------------
    def _consistency(self, msg: ConsistencyRequest) -> ConsistencySignature:
        params = self._expect(Stage.CONSISTENCY, msg, msg.round_id, msg.site)
        assert self._identity is not None  # checked at setup
        graph = neighbour_graph(self._alive, params.k, params.graph_seed)
        senders = set(self._held) - {self.site}
        consistency.check_survivor_set(self.site, params, graph, senders, msg.survivors)
        me = self._known[self.site][0]
        statement = survivors_statement(
            params.round_id, self.site, me.enc_key, me.mask_key, msg.survivors
        )
        self._signed = tuple(msg.survivors)
        self._stage = Stage.UNMASK
        macs = tuple(
            (v, crypto.attest(key, statement)) for v, key in sorted(self._attest_keys.items())
        )
        return ConsistencySignature(
            params.round_id, self.site, self._identity.sign(statement), macs
        )

    # -- stage 4 -------------------------------------------------------------------
    def _unmask(self, msg: UnmaskRequest) -> UnmaskShares:
        params = self._expect(Stage.UNMASK, msg, msg.round_id, msg.site)
        survivors, dropped = set(msg.survivors), set(msg.dropped)
        if len(survivors) != len(msg.survivors) or len(dropped) != len(msg.dropped):
            raise SecAggError(f"site {self.site}: unmask request lists a site twice")
        both = survivors & dropped
        if both:
            raise SecAggError(
                f"site {self.site}: refusing to reveal both secrets of sites {sorted(both)} "
                f"(listed as survived and dropped); this would expose their updates"
            )
        if self.site not in survivors:
            raise SecAggError(f"site {self.site}: unmask request does not list me as survived")
        unknown = (survivors | dropped) - set(self._held)
        if unknown:
            raise SecAggError(
                f"site {self.site}: asked for shares of {sorted(unknown)}, which I do not hold"
            )
        if len(survivors) < params.t:
            raise SecAggError(
                f"site {self.site}: only {len(survivors)} of my share owners survived, fewer "
                f"than t={params.t}; refusing to help unmask so small a sum"
            )
        if params.consistency_check:
            self._check_consistency(params, msg)
        seed_shares = tuple((o, self._held[o][0].to_bytes()) for o in sorted(survivors))
        key_shares = tuple((o, self._held[o][1].to_bytes()) for o in sorted(dropped))
        self._held.clear()
        self._attest_keys.clear()
        self._stage = Stage.DONE
        return UnmaskShares(params.round_id, self.site, seed_shares, key_shares)

    def _check_consistency(self, params: RoundParams, msg: UnmaskRequest) -> None:
        """Rules R2 and R3 of `fedtrain.secagg.consistency` before revealing anything."""
        signed = self._signed
        assert signed is not None and self._verifier is not None  # stage 3 passed
        u3 = set(signed)
        want_survivors = sorted(set(self._held) & u3)
        want_dropped = sorted(set(self._held) - u3)
        if sorted(msg.survivors) != want_survivors or sorted(msg.dropped) != want_dropped:
            raise SecAggError(
                f"site {self.site}, {describe(params.round_id)}: the unmask request (survived "
                f"{sorted(msg.survivors)}, dropped {sorted(msg.dropped)}) contradicts the "
                f"survivor set I signed (survived {want_survivors}, dropped {want_dropped}); "
                "refusing to reveal"
            )
        known = {s: (a, peer) for s, (a, peer) in self._known.items() if peer is not None}
        consistency.check_reveal(
            site=self.site,
            params=params,
            graph=neighbour_graph(self._alive, params.k, params.graph_seed),
            survivors=signed,
            held=self._held,
            commitments=self._commitments,
            known=known,
            forwarded=msg.keys,
            signatures=dict(msg.signatures),
            attestations={
                s: (self._attest_keys[s], mac) for s, mac in msg.macs if s in self._attest_keys
            },
            verifier=self._verifier,
        )


class SecAggServer:
    """The server's side of one round.

    ``start()`` -> messages; ``receive()`` replies; ``advance()`` closes a stage and
    returns the next stage's messages; ``finish()`` closes the unmasking stage and
    returns the :class:`SecAggResult`. A bad message raises SecAggError and leaves the
    state unchanged (the sender simply counts as not having replied). A stage that
    cannot complete (too many dropouts) raises SecAggError and the round is FAILED.
    """

    def __init__(
        self,
        params: RoundParams,
        expander: crypto.MaskExpander | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.params = params
        self.quantizer = validate_params(params)
        self._expander = expander if expander is not None else crypto.MaskExpander()
        # Checks advertisements and survivor-set signatures as they arrive, so a site
        # whose credential or signature is bad is dropped here instead of making all its
        # neighbours refuse the round (they check everything again themselves).
        self._verifier = verifier
        self._peers: dict[int, VerifiedPeer] = {}
        self._stage = Stage.SETUP
        self._started = False
        self._all = frozenset(params.sites)
        self._keys: dict[int, AdvertiseKeys] = {}
        self._graph: dict[int, frozenset[int]] = {}
        self._ciphertexts: dict[int, dict[int, bytes]] = {}
        self._u2: frozenset[int] = frozenset()
        self._agg = ModularSumAggregator(params.vector_length + 1)
        self._progress: dict[int, int] = {}
        self._journal: dict[int, list[np.ndarray]] = {}
        self._u3: set[int] = set()
        self._signatures: dict[int, bytes] = {}  # stage 3: site -> its signature of U3
        self._macs: dict[int, dict[int, bytes]] = {}  # stage 3: site -> neighbour -> MAC
        self._revealers: frozenset[int] = frozenset()  # asked to reveal in stage 4
        self._requests: dict[int, UnmaskRequest] = {}
        self._seed_shares: dict[int, list[shamir.Share]] = {}
        self._key_shares: dict[int, list[shamir.Share]] = {}
        self._u4: set[int] = set()

    @classmethod
    def from_config(
        cls,
        config: SecAggConfig,
        round_id: int,
        sites: Iterable[int],
        vector_length: int,
        graph_seed: bytes | None = None,
        min_included: int = 0,
        verifier: Verifier | None = None,
    ) -> SecAggServer:
        params = config.round_params(round_id, sites, vector_length, graph_seed, min_included)
        return cls(params, verifier=verifier)

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def pending(self) -> frozenset[int]:
        """Sites whose reply to the current stage has not arrived (yet)."""
        if self._stage == Stage.SETUP:
            return self._all - set(self._keys)
        if self._stage == Stage.SHARE_KEYS:
            return frozenset(self._keys) - set(self._ciphertexts)
        if self._stage == Stage.MASKED_INPUT:
            return self._u2 - self._u3
        if self._stage == Stage.CONSISTENCY:
            return frozenset(self._u3) - set(self._signatures)
        if self._stage == Stage.UNMASK:
            return self._revealers - self._u4
        return frozenset()

    def _fail(self, message: str) -> SecAggError:
        self._stage = Stage.FAILED
        self._journal.clear()
        where = describe(self.params.round_id)
        logger.warning("secure aggregation of %s failed: %s", where, message)
        return SecAggError(f"{where}: {message}")

    def _check(self, msg: ClientMessage, stage: Stage, allowed: Iterable[int]) -> None:
        name = type(msg).__name__
        if msg.round_id != self.params.round_id:
            raise SecAggError(
                f"{name} from site {msg.site} is for {describe(msg.round_id)}, "
                f"not {describe(self.params.round_id)}"
            )
        if self._stage != stage:
            raise SecAggError(
                f"{describe(self.params.round_id)}: {name} from site {msg.site} arrived in "
                f"stage {self._stage.name}; ignored (the site counts as dropped)"
            )
        if msg.site not in allowed:
            raise SecAggError(
                f"{describe(self.params.round_id)}: {name} from site {msg.site}, which is not "
                f"expected in stage {stage.name}"
            )

    # -- stage 0 -------------------------------------------------------------------
    def start(self) -> dict[int, SetupRequest]:
        """The setup messages, one per site of the round."""
        if self._started:
            raise SecAggError(f"{describe(self.params.round_id)}: already started")
        self._started = True
        return {s: SetupRequest(s, self.params) for s in self.params.sites}

    def receive(self, msg: ClientMessage) -> None:
        """Take one site's reply to the current stage."""
        if isinstance(msg, AdvertiseKeys):
            self._receive_keys(msg)
        elif isinstance(msg, ShareKeys):
            self._receive_shares(msg)
        elif isinstance(msg, MaskedInput):
            self._check(msg, Stage.MASKED_INPUT, self._u2)
            self.receive_masked_chunk(msg.site, 0, msg.vector)
            if msg.site not in self._u3:
                raise self._incomplete(msg.site)
        elif isinstance(msg, ConsistencySignature):
            self._receive_signature(msg)
        elif isinstance(msg, UnmaskShares):
            self._receive_unmask(msg)
        else:
            raise SecAggError(f"unexpected message {type(msg).__name__}")

    def _receive_keys(self, msg: AdvertiseKeys) -> None:
        self._check(msg, Stage.SETUP, self._all)
        if msg.site in self._keys:
            raise SecAggError(f"site {msg.site} advertised keys twice")
        for key in (msg.enc_key, msg.mask_key):
            if len(key) != crypto.KEY_BYTES:
                raise SecAggError(f"site {msg.site} advertised a {len(key)}-byte public key")
        if msg.enc_key == msg.mask_key:
            raise SecAggError(f"site {msg.site} advertised the same key twice")
        if self._verifier is not None:
            peer = self._verifier.verify(msg.site, msg.credential)
            statement = advertisement_statement(msg.round_id, msg.site, msg.enc_key, msg.mask_key)
            if not peer.signed(msg.signature, statement):
                raise SecAggError(
                    f"site {msg.site} ({peer.name!r}) advertised keys its certified key did "
                    "not sign"
                )
            self._peers[msg.site] = peer
        self._keys[msg.site] = msg

    # -- stage 1 -------------------------------------------------------------------
    def _close_setup(self) -> dict[int, KeysBroadcast]:
        alive = tuple(sorted(self._keys))
        p = self.params
        d = effective_degree(p.k, max(len(alive), 1))
        if len(alive) < 2 or d + 1 < p.t:
            raise self._fail(
                f"only {len(alive)} of {len(p.sites)} sites advertised keys; each site "
                f"would have {d + 1} share holders, fewer than t={p.t}"
            )
        self._graph = neighbour_graph(alive, p.k, p.graph_seed)
        logger.debug(
            "secure aggregation, %s: %d/%d sites advertised keys",
            describe(p.round_id),
            len(alive),
            len(p.sites),
        )
        return {
            u: KeysBroadcast(
                p.round_id, u, alive, tuple(self._keys[v] for v in sorted(self._graph[u]))
            )
            for u in alive
        }

    def _receive_shares(self, msg: ShareKeys) -> None:
        self._check(msg, Stage.SHARE_KEYS, self._graph)
        if msg.site in self._ciphertexts:
            raise SecAggError(f"site {msg.site} sent its shares twice")
        receivers = [r for r, _ in msg.ciphertexts]
        if len(set(receivers)) != len(receivers) or set(receivers) != self._graph[msg.site]:
            raise SecAggError(
                f"site {msg.site} sent shares to {sorted(receivers)}, but its neighbours are "
                f"{sorted(self._graph[msg.site])}"
            )
        for r, ct in msg.ciphertexts:
            if len(ct) != _MAX_CIPHERTEXT:
                raise SecAggError(
                    f"site {msg.site}: share ciphertext for {r} is {len(ct)} bytes, "
                    f"expected {_MAX_CIPHERTEXT}"
                )
        self._ciphertexts[msg.site] = dict(msg.ciphertexts)

    def _close_share_keys(self) -> dict[int, RoutedShares]:
        p = self.params
        u2 = set(self._ciphertexts)
        changed = True
        while changed:  # prune sites whose self-mask could never be removed
            changed = False
            for u in sorted(u2):
                if len(self._graph[u] & u2) + 1 < p.t:
                    u2.discard(u)
                    changed = True
                    logger.info(
                        "secure aggregation, %s: site %d has fewer than t-1=%d neighbours "
                        "that shared keys; excluded",
                        describe(p.round_id),
                        u,
                        p.t - 1,
                    )
        if len(u2) < 2:
            raise self._fail(
                f"only {len(u2)} sites can take part after stage 1 ({len(self._ciphertexts)} "
                f"shared keys, t={p.t}); too many dropouts"
            )
        self._u2 = frozenset(u2)
        logger.debug("secure aggregation, %s: %d sites shared keys", describe(p.round_id), len(u2))
        return {
            v: RoutedShares(
                p.round_id,
                v,
                tuple((u, self._ciphertexts[u][v]) for u in sorted(self._graph[v] & u2)),
            )
            for v in sorted(u2)
        }

    # -- stage 2 -------------------------------------------------------------------
    def receive_masked_chunk(self, site: int, offset: int, chunk: np.ndarray) -> bool:
        """Fold one chunk of ``site``'s masked vector in; True once the vector is complete.

        Chunks must arrive in order (``offset`` = elements received so far). They are
        added to the sum at once; until the vector is complete a copy is kept so that
        :meth:`abort_masked_input` can take it out again if the stream breaks.
        """
        if self._stage != Stage.MASKED_INPUT:
            raise SecAggError(
                f"{describe(self.params.round_id)}: masked data from site {site} in stage "
                f"{self._stage.name}; ignored"
            )
        if site not in self._u2:
            raise SecAggError(
                f"{describe(self.params.round_id)}: masked data from site {site}, which did not "
                f"take part in key sharing"
            )
        if site in self._u3:
            raise SecAggError(f"{describe(self.params.round_id)}: site {site} sent its input twice")
        expected = self._progress.get(site, 0)
        if offset != expected:
            raise SecAggError(
                f"{describe(self.params.round_id)}: site {site} chunk at offset {offset}, "
                f"expected {expected}"
            )
        chunk = np.asarray(chunk)
        self._agg.add(chunk, offset)
        end = offset + chunk.shape[0]
        if end == self._agg.length:
            self._progress.pop(site, None)
            self._journal.pop(site, None)
            self._u3.add(site)
            return True
        self._progress[site] = end
        self._journal.setdefault(site, []).append(chunk.copy())
        return False

    def abort_masked_input(self, site: int) -> None:
        """Take out the chunks of a broken stream; the site counts as dropped."""
        chunks = self._journal.pop(site, [])
        self._progress.pop(site, None)
        offset = 0
        for chunk in chunks:
            self._agg.subtract(chunk, offset)
            offset += chunk.shape[0]
        if chunks:
            logger.info(
                "secure aggregation, %s: site %d's masked input broke after %d of %d "
                "values; treated as dropped",
                describe(self.params.round_id),
                site,
                offset,
                self._agg.length,
            )

    def _incomplete(self, site: int) -> SecAggError:
        self.abort_masked_input(site)
        return SecAggError(
            f"{describe(self.params.round_id)}: masked input of site {site} is shorter than "
            f"{self._agg.length} values; dropped"
        )

    def _holders(self, owner: int) -> frozenset[int]:
        """Sites holding ``owner``'s shares: its neighbours in U2, and itself."""
        return (self._graph[owner] & self._u2) | {owner}

    def _close_masked_input(self) -> dict[int, ServerMessage]:
        p = self.params
        for site in list(self._journal):
            self.abort_masked_input(site)
        u3 = frozenset(self._u3)
        dropped = self._u2 - u3
        if len(u3) < p.t:
            raise self._fail(
                f"only {len(u3)} masked inputs arrived, fewer than t={p.t}; too many dropouts"
            )
        if len(u3) < p.dp_min_survivors:
            raise self._fail(
                f"only {len(u3)} masked inputs arrived, fewer than the {p.dp_min_survivors} "
                "sites whose noise distributed DP needs in the sum; not unmasking it"
            )
        if len(u3) < p.min_included:
            raise self._fail(
                f"only {len(u3)} masked inputs arrived, fewer than the {p.min_included} the "
                "round needs to count; its sum stays masked (a retry starts afresh)"
            )
        short = [
            f"site {u} ({len(self._holders(u) & u3)} holders left)"
            for u in sorted(u3)
            if len(self._holders(u) & u3) < p.t
        ]
        short += [
            f"dropped site {v} ({len(self._holders(v) & u3)} holders left)"
            for v in sorted(dropped)
            if self._graph[v] & u3 and len(self._holders(v) & u3) < p.t
        ]
        if short:
            raise self._fail(
                "too many dropouts to unmask: fewer than t="
                f"{p.t} surviving share holders for " + ", ".join(short)
            )
        parts = components(u3, self._graph)
        if len(parts) > 1:
            raise self._fail(
                f"the {len(u3)} masked inputs fall apart into {len(parts)} groups with no pair "
                f"mask between them (sizes {sorted(len(part) for part in parts)}): unmasking "
                "would reveal each group's sum; too many dropouts"
            )
        logger.debug(
            "secure aggregation, %s: %d masked inputs, %d dropped after sharing",
            describe(p.round_id),
            len(u3),
            len(dropped),
        )
        if p.consistency_check:
            survivors = tuple(sorted(u3))
            return {u: ConsistencyRequest(p.round_id, u, survivors) for u in survivors}
        return self._unmask_requests(u3)

    def _unmask_requests(self, revealers: frozenset[int]) -> dict[int, UnmaskRequest]:
        """Stage 4's requests, to ``revealers`` (U3, or those of U3 that signed it)."""
        p = self.params
        u3 = frozenset(self._u3)
        dropped = self._u2 - u3
        self._revealers = revealers
        self._requests = {}
        for u in sorted(revealers):
            signatures: tuple[tuple[int, bytes], ...] = ()
            keys: tuple[AdvertiseKeys, ...] = ()
            macs: tuple[tuple[int, bytes], ...] = ()
            if p.consistency_check:
                # Every holder of every owner u holds shares of: u checks t signatures each.
                wanted = set().union(
                    *(consistency.holders(o, self._graph) for o in self._holders(u))
                )
                signatures = tuple(
                    (s, self._signatures[s]) for s in sorted(wanted & set(self._signatures))
                )
                keys = tuple(self._keys[s] for s in sorted(wanted - self._graph[u] - {u}))
                macs = tuple(
                    (s, self._macs[s][u])
                    for s in sorted(self._graph[u] & set(self._macs))
                    if u in self._macs[s]
                )
            self._requests[u] = UnmaskRequest(
                p.round_id,
                u,
                tuple(sorted(self._holders(u) & u3)),
                tuple(sorted(self._graph[u] & dropped)),
                signatures,
                keys,
                macs,
            )
        return dict(self._requests)

    # -- stage 3 -------------------------------------------------------------------
    def _receive_signature(self, msg: ConsistencySignature) -> None:
        self._check(msg, Stage.CONSISTENCY, self._u3)
        if msg.site in self._signatures:
            raise SecAggError(f"site {msg.site} signed the survivor set twice")
        macs = dict(msg.macs)
        if len(macs) != len(msg.macs) or not set(macs) <= self._graph[msg.site]:
            raise SecAggError(
                f"site {msg.site} attested the survivor set to {sorted(macs)}, which are not "
                f"distinct neighbours of it"
            )
        peer = self._peers.get(msg.site)
        if peer is not None:
            advert = self._keys[msg.site]
            statement = survivors_statement(
                msg.round_id, msg.site, advert.enc_key, advert.mask_key, sorted(self._u3)
            )
            if not peer.signed(msg.signature, statement):
                raise SecAggError(
                    f"site {msg.site} ({peer.name!r}): its signature of the survivor set does "
                    "not verify"
                )
        self._signatures[msg.site] = msg.signature
        self._macs[msg.site] = macs

    def _close_consistency(self) -> dict[int, UnmaskRequest]:
        """Ask the signers to reveal, if every owner still has t signers among its holders."""
        p = self.params
        signers = frozenset(self._signatures)
        u3 = frozenset(self._u3)
        needed = sorted(u3) + sorted(v for v in self._u2 - u3 if self._graph[v] & u3)
        short = [
            f"site {o} ({len(consistency.holders(o, self._graph) & signers)} signed)"
            for o in needed
            if len(consistency.holders(o, self._graph) & signers) < p.t
        ]
        if short:
            raise self._fail(
                f"only {len(signers)} of {len(u3)} included sites signed the survivor set; "
                f"fewer than t={p.t} share holders signed it for " + ", ".join(short)
            )
        return self._unmask_requests(signers)

    # -- stage 4 -------------------------------------------------------------------
    def _receive_unmask(self, msg: UnmaskShares) -> None:
        self._check(msg, Stage.UNMASK, self._revealers)
        if msg.site in self._u4:
            raise SecAggError(f"site {msg.site} sent its unmasking shares twice")
        request = self._requests[msg.site]
        seed_owners = [o for o, _ in msg.seed_shares]
        key_owners = [o for o, _ in msg.key_shares]
        if seed_owners != list(request.survivors) or key_owners != list(request.dropped):
            raise SecAggError(
                f"site {msg.site} revealed shares of {seed_owners}/{key_owners}, but was "
                f"asked for {list(request.survivors)}/{list(request.dropped)}"
            )
        parsed: list[tuple[int, shamir.Share, bool]] = []
        for owners, is_seed in ((msg.seed_shares, True), (msg.key_shares, False)):
            for owner, raw in owners:
                share = shamir.Share.from_bytes(raw)
                if (share.x, share.threshold, share.secret_len) != (msg.site, self.params.t, 32):
                    raise SecAggError(
                        f"site {msg.site}: share of site {owner} has wrong parameters"
                    )
                parsed.append((owner, share, is_seed))
        for owner, share, is_seed in parsed:
            target = self._seed_shares if is_seed else self._key_shares
            target.setdefault(owner, []).append(share)
        self._u4.add(msg.site)

    def advance(self) -> dict[int, ServerMessage]:
        """Close the current stage (late replies are dropouts); the next stage's messages."""
        if not self._started:
            raise SecAggError(f"{describe(self.params.round_id)}: call start() first")
        out: dict[int, ServerMessage]
        if self._stage == Stage.SETUP:
            out = dict(self._close_setup())
        elif self._stage == Stage.SHARE_KEYS:
            out = dict(self._close_share_keys())
        elif self._stage == Stage.MASKED_INPUT:
            out = dict(self._close_masked_input())
        elif self._stage == Stage.CONSISTENCY:
            out = dict(self._close_consistency())
        else:
            raise SecAggError(
                f"{describe(self.params.round_id)}: cannot advance from stage {self._stage.name}"
                + ("; call finish()" if self._stage == Stage.UNMASK else "")
            )
        skip = self._stage == Stage.MASKED_INPUT and not self.params.consistency_check
        self._stage = Stage(self._stage + (2 if skip else 1))
        return out

    def finish(self) -> SecAggResult:
        """Close the unmasking stage, remove every mask, return the sum."""
        p = self.params
        if self._stage != Stage.UNMASK:
            raise SecAggError(f"{describe(p.round_id)}: finish() in stage {self._stage.name}")
        u3 = sorted(self._u3)
        dropped = sorted(v for v in self._u2 - self._u3 if self._graph[v] & self._u3)
        short = [
            f"site {u} ({len(self._seed_shares.get(u, []))} seed shares)"
            for u in u3
            if len(self._seed_shares.get(u, [])) < p.t
        ]
        short += [
            f"dropped site {v} ({len(self._key_shares.get(v, []))} key shares)"
            for v in dropped
            if len(self._key_shares.get(v, [])) < p.t
        ]
        if short:
            raise self._fail(
                f"only {len(self._u4)} of {len(self._revealers)} sites asked revealed shares; "
                f"fewer than t={p.t} for " + ", ".join(short)
            )
        total = self._agg.array
        masks = [(shamir.combine(self._seed_shares[u]), -1) for u in u3]
        for v in dropped:
            raw = shamir.combine(self._key_shares[v])
            key = crypto.KeyPair.from_private_bytes(raw)
            if key.public != self._keys[v].mask_key:
                raise self._fail(
                    f"the mask key of dropped site {v} rebuilt from shares does not match the "
                    f"key it advertised: a share is corrupt"
                )
            for u in sorted(self._graph[v] & self._u3):
                shared = key.exchange(self._keys[u].mask_key)
                seed = crypto.pair_mask_seed(shared, p.round_id, u, v)
                masks.append((seed, -_sign(u, v)))
        self._expander.apply_many(total, masks)
        self._stage = Stage.DONE
        included = tuple(u3)
        logger.info(
            "secure aggregation, %s: unmasked the sum of %d/%d sites",
            describe(p.round_id),
            len(included),
            len(p.sites),
        )
        return SecAggResult(
            round_id=p.round_id,
            total=total,
            included=included,
            dropped=tuple(sorted(self._all - self._u3)),
            quantizer=self.quantizer,
        )
