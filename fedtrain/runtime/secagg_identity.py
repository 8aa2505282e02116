"""Secure-aggregation identities from the sites' mTLS certificates.

A site's advertised keys must be bound to the site, or a malicious server hands its
neighbours keys of its own and reads the shares (`fedtrain.secagg.identity`). The
binding reuses what the federation already has, the site certificate from
`fedtrain ca issue-site` (EC P-256, CN = SAN = site name):

* When the daemon starts, the site makes an **Ed25519 signing key** and signs its
  public half with the **certificate's key** (ECDSA-SHA256, under a fixed label). The
  *credential* it attaches to every advertisement is its certificate (DER), that
  endorsement and the Ed25519 key; the server forwards it to the site's neighbours.
* A verifier (every site, and the server) checks a credential as a TLS handshake
  would check the certificate (the checks of a join, `tls.verify_issued`): issued by
  the federation CA (``tls.ca``), inside its validity window now, clientAuth, one valid
  site name; then the endorsement with the certificate's key. Only then is the Ed25519
  key that site's.

What the check binds is *distinct certified sites*, not a name per secagg id: a site
refuses neighbours whose certificates repeat a name (one site, or one colluder, in
two of its share-holder slots), and the server, which numbers the sites, checks that
each id's credential carries the name it assigned. The sites are not told the name of
every id: that would show each site the whole round's participants, and the
protocol's guarantees (`fedtrain.secagg.consistency`) need only that the ``k + 1``
holders of a site are ``k + 1`` different sites with the keys the owner saw.

Why a per-start Ed25519 key rather than the certificate key directly, or a key per
round: the certificate key then signs once per daemon start, not per message; the
endorsement, and the certificate chain, are verified once per neighbour per start
(cached by credential; the validity window is checked again every time); and a
statement signed by this key always names the protocol instance (its fresh X25519
keys), so reusing the key across rounds gives a server nothing to replay.
"""

from __future__ import annotations

import datetime as dt
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.verification import (
    ClientVerifier,
    PolicyBuilder,
    Store,
    VerificationError,
)

from fedtrain.errors import CertificateError, SecAggError
from fedtrain.runtime import tls
from fedtrain.secagg.identity import PUBLIC_KEY_BYTES, SigningIdentity, VerifiedPeer

#: What the certificate key signs: this label, then the Ed25519 public key.
ENDORSEMENT_LABEL = b"fedtrain/secagg/v1/signing-key"
_CACHE_LIMIT = 4096


def _pack(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _unpack(data: bytes, count: int) -> list[bytes]:
    parts, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(data):
            raise ValueError("truncated")
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ValueError("truncated")
        parts.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} trailing bytes")
    return parts


def load_identity(cert_path: str | Path, key_path: str | Path) -> SigningIdentity:
    """A fresh Ed25519 signing identity endorsed by this site's certificate key."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(
            f"site key {key_path} is a {type(key).__name__}; secure aggregation endorses its "
            "signing key with the EC key that `fedtrain ca issue-site` makes"
        )
    signing = Ed25519PrivateKey.generate()
    public = signing.public_key().public_bytes_raw()
    endorsement = key.sign(ENDORSEMENT_LABEL + public, ec.ECDSA(hashes.SHA256()))
    der = cert.public_bytes(serialization.Encoding.DER)
    return SigningIdentity(signing, _pack(der, endorsement, public))


@dataclass(frozen=True)
class _Checked:
    name: str
    not_before: dt.datetime
    not_after: dt.datetime
    key: Ed25519PublicKey


class CertificateVerifier:
    """A :class:`~fedtrain.secagg.identity.Verifier` for certificate credentials.

    ``names`` (the server's view): the site name each secagg id must carry. Thread-safe;
    :meth:`expecting` makes views with other names that share the cache.
    """

    def __init__(
        self,
        ca: x509.Certificate,
        names: Mapping[int, str] | None = None,
        *,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc),
        _cache: dict[bytes, _Checked] | None = None,
        _lock: threading.Lock | None = None,
    ) -> None:
        self._ca = ca
        self._names = dict(names) if names is not None else None
        self._clock = clock
        self._cache = _cache if _cache is not None else {}
        self._lock = _lock if _lock is not None else threading.Lock()

    @classmethod
    def from_file(cls, ca_path: str | Path) -> CertificateVerifier:
        return cls(x509.load_pem_x509_certificate(Path(ca_path).read_bytes()))

    def expecting(self, names: Mapping[int, str]) -> CertificateVerifier:
        """This verifier, also checking that secagg id ``i`` carries ``names[i]``."""
        return CertificateVerifier(
            self._ca, names, clock=self._clock, _cache=self._cache, _lock=self._lock
        )

    def verify(self, site: int, credential: bytes) -> VerifiedPeer:
        with self._lock:
            checked = self._cache.get(credential)
        if checked is None:
            checked = self._check(site, credential)
            with self._lock:
                if len(self._cache) >= _CACHE_LIMIT:
                    self._cache.clear()
                self._cache[credential] = checked
        now = self._clock()
        if not checked.not_before <= now <= checked.not_after:
            raise SecAggError(
                f"the certificate of site {site} ({checked.name!r}) is not valid now: valid "
                f"from {checked.not_before:%Y-%m-%d %H:%M} to {checked.not_after:%Y-%m-%d %H:%M} "
                "UTC"
            )
        if self._names is not None and self._names.get(site) != checked.name:
            raise SecAggError(
                f"secagg id {site} is {self._names.get(site)!r} this round, but its credential "
                f"is {checked.name!r}'s"
            )
        return VerifiedPeer(checked.name, checked.key)

    def _policy(self) -> ClientVerifier:
        return PolicyBuilder().store(Store([self._ca])).time(self._clock()).build_client_verifier()

    def _check(self, site: int, credential: bytes) -> _Checked:
        try:
            der, endorsement, public = _unpack(credential, 3)
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise SecAggError(f"site {site}'s identity credential is malformed ({exc})") from None
        subject = cert.subject.rfc4514_string()
        try:
            # The checks a site's certificate gets at join (fedtrain.runtime.peer_auth).
            tls.verify_issued(
                cert,
                self._ca,
                purpose="site",
                where=f"certificate '{subject}'",
                ca_label=f"'{self._ca.subject.rfc4514_string()}'",
                foreign_fix="it belongs to another federation",
                renew="its site must be issued a new one",
                now=self._clock(),
            )
            name = tls.site_name_of(cert)
            self._policy().verify(cert, [])  # and RFC 5280's rules, the join's last gate
        except (CertificateError, VerificationError) as exc:
            raise SecAggError(f"site {site}'s certificate does not verify: {exc}") from None
        if name is None:  # pragma: no cover - verify_issued refuses a site without a name
            raise SecAggError(f"site {site}'s certificate names no site")
        cert_key = cert.public_key()
        if not isinstance(cert_key, ec.EllipticCurvePublicKey) or len(public) != PUBLIC_KEY_BYTES:
            raise SecAggError(f"site {site} ({name!r}): its credential holds no EC-endorsed key")
        try:
            cert_key.verify(endorsement, ENDORSEMENT_LABEL + public, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise SecAggError(
                f"site {site} ({name!r}): its signing key is not endorsed by its certificate's key"
            ) from None
        return _Checked(
            name,
            cert.not_valid_before_utc,
            cert.not_valid_after_utc,
            Ed25519PublicKey.from_public_bytes(public),
        )
