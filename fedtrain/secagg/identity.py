"""Who is who in a round: site identities, as the protocol objects see them.

Without identities, nothing ties an advertised public key to a site: a malicious
server can hand a site forged keys for its neighbours, decrypt the shares sent under
them and collect both secrets of a victim. With identities, each site signs what it
advertises (``round, secagg id, share-encryption key, mask key``) and, with the
consistency check, the survivor set it was told, with an **Ed25519** key; every site
checks those signatures against keys that a :class:`Verifier` vouches for.

The state machines stay free of I/O and of any certificate format; they see two
small interfaces, and a driver plugs in what it has:

* :class:`Identity` (this site): a ``credential`` (opaque bytes that prove who owns
  the signing key) and ``sign(message)``;
* :class:`Verifier` (everyone else): ``verify(site, credential)`` returns the verified
  signing key and the name it is certified for, or raises SecAggError.

The runtime's credential is the site's mTLS certificate plus an ECDSA signature, by
the certificate's key, over the Ed25519 key (`fedtrain.runtime.secagg_identity`); the
simulation's and the tests' is :class:`InMemoryPKI`, a registry of names and keys.

Why Ed25519 and not the certificate's P-256 key directly: a site signs two statements
per round and verifies a few dozen, and Ed25519 signatures are deterministic (no
nonce to get wrong) and verify faster; the certificate key signs once, when the site
starts, to certify the Ed25519 key.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedtrain.errors import SecAggError

SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
_DOMAIN = b"fedtrain/secagg/v1/"


@dataclass(frozen=True)
class VerifiedPeer:
    """A credential's verified signing key and the name it is certified for."""

    name: str
    key: Ed25519PublicKey

    def signed(self, signature: bytes, statement: bytes) -> bool:
        """Whether ``signature`` is this peer's Ed25519 signature of ``statement``."""
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self.key.verify(signature, statement)
        except InvalidSignature:
            return False
        return True


class Identity(Protocol):
    """This site's signing identity (see the module docstring)."""

    @property
    def credential(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


class Verifier(Protocol):
    """Maps a peer's credential to its verified signing key, or raises SecAggError.

    ``site`` is the secagg id the credential was presented for (for error messages,
    and for a verifier that knows which name each id must carry).
    """

    def verify(self, site: int, credential: bytes) -> VerifiedPeer: ...


class SigningIdentity:
    """An Ed25519 key and the credential that certifies it: an :class:`Identity`."""

    def __init__(self, key: Ed25519PrivateKey, credential: bytes) -> None:
        self._key = key
        self._credential = credential

    @property
    def credential(self) -> bytes:
        return self._credential

    @property
    def public_key(self) -> bytes:
        return self._key.public_key().public_bytes_raw()

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def advertisement_statement(round_id: int, site: int, enc_key: bytes, mask_key: bytes) -> bytes:
    """What a site signs in :class:`~fedtrain.secagg.messages.AdvertiseKeys`."""
    return (
        _DOMAIN
        + b"advertise"
        + struct.pack("<QI", round_id, site)
        + _blob(enc_key)
        + _blob(mask_key)
    )


def survivors_statement(
    round_id: int, site: int, enc_key: bytes, mask_key: bytes, survivors: Iterable[int]
) -> bytes:
    """What a site signs in the consistency check: the survivor set U3 it was told.

    The signer's own advertised keys are part of it, so a signature belongs to one
    protocol instance (one client object): a site whose round was restarted signs
    again with fresh keys, and its old signature cannot be counted for the new instance.
    """
    ids = tuple(survivors)
    return (
        _DOMAIN
        + b"survivors"
        + struct.pack("<QI", round_id, site)
        + _blob(enc_key)
        + _blob(mask_key)
        + struct.pack(f"<I{len(ids)}I", len(ids), *ids)
    )


def _blob(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


class InMemoryPKI:
    """Certifies Ed25519 keys by name, in memory: the simulation's and the tests' PKI.

    A credential is the name and the public key; it verifies if that name was enrolled
    with that key. Enrolling a name again replaces its key (a restarted site).
    """

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}

    def enrol(self, name: str) -> SigningIdentity:
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes_raw()
        self._keys[name] = public
        encoded = name.encode()
        return SigningIdentity(key, struct.pack("<H", len(encoded)) + encoded + public)

    def verify(self, site: int, credential: bytes) -> VerifiedPeer:
        if len(credential) < 2:
            raise SecAggError(f"site {site} presented no identity credential")
        (n,) = struct.unpack_from("<H", credential)
        name = credential[2 : 2 + n].decode(errors="replace")
        public = credential[2 + n :]
        if len(public) != PUBLIC_KEY_BYTES or self._keys.get(name) != public:
            raise SecAggError(f"site {site}'s credential for {name!r} is not enrolled in this PKI")
        return VerifiedPeer(name, Ed25519PublicKey.from_public_bytes(public))
