"""Who is at the other end of a stream: site and operator authentication at join.

The server must record every peer it refuses, with its address and why (another CA,
expired, not yet valid, wrong key usage, not on the allow-list, no certificate, a key
that does not match), because operators have to answer "who tried to get in?". With
grpcio that rules out refusing client certificates in the TLS handshake:

- ``grpc.ssl_server_credentials(require_client_auth=True)`` has BoringSSL verify the
  client's chain and validity in the handshake and close the socket on failure. Python
  never hears of it: no handler runs, and the only trace is a C-core line on stderr
  ("Handshake failed ... certificate has expired") without the peer's address or
  the certificate's subject.
- ``require_client_auth=False`` does not *request* a client certificate at all.
  grpcio's binding (``_cygrpc/credentials.pyx.pxi``, ``server_credentials_ssl``) maps
  the flag to either ``GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY`` or
  ``GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE``; C-core's "request but don't verify"
  modes and its custom verifier are not exposed (grpc/grpc#32635, #16547), so a
  permissive handshake that still hands the certificate to Python is impossible.
  ``dynamic_ssl_server_credentials`` only swaps the server's own certificate: its
  fetcher runs before each handshake with no peer and no outcome.
- Parsing gRPC's own log lines (fd 2, ``GRPC_TRACE=handshaker``) is rejected: the peer
  address appears only in DEBUG traces gRPC itself calls unfit for production,
  spread over several lines interleaved between threads, in a format that is no API
  and changes between releases, and still without the certificate's subject.

So the TLS handshake authenticates the *server* only (sites still verify it against
the federation CA and its host name, and the channel is encrypted as before), and the
peer proves its identity as the first thing on its stream:

1. the server sends a :class:`~pb.Challenge` (32 random bytes) as the first message on
   ``Control`` and ``Status``;
2. the peer answers with a :class:`~pb.Proof`: its certificate, the server name it
   verified the server's certificate for, and its certificate key's signature over
   :func:`transcript` (a label, the purpose, the nonce and that server name);
3. the server checks the signature (the peer holds the key), then the certificate with
   :func:`fedtrain.runtime.tls.verify_issued` (the same checks, in the same words, as a
   site's own start-up check, each with a one-word ``cause``), then with
   ``cryptography``'s RFC 5280 client verifier as the final gate, then the server name;
   the servicer then checks the allow-list. Every refusal becomes an audit record
   (``join_refused`` / ``status_refused``) with the peer address, the cause, the
   subject and the issuer, and the peer gets a message that says what is wrong and
   what to do.

The nonce is fresh per stream and only the TLS peer of that connection sees it, so a
proof cannot be replayed; the server name in the transcript stops a server that
shares the CA from relaying a site's proof to another server; the label and purpose
keep these signatures apart from any other use of the site's key. Bulk RPCs carry the
session token of an authenticated control stream and must arrive on that stream's
connection (the servicer checks both), so authentication happens once per session and
costs the bulk path a lookup, nothing per chunk.

What this gives up, and how it is bounded: a peer without a certificate now completes
the TLS handshake and reaches gRPC's HTTP/2 stack and the admission code. It can hold
a worker thread only until the join deadline, only a few at a time (per address and
in all: ``fedtrain.runtime.server.admission``), and it reaches no bulk RPC (no session on
its connection) and no status. While such peers fill the admission gate, a site's
join is refused as ``busy`` and retried with its backoff: an anonymous peer can delay
joins (never a joined site), which a handshake that demands certificates would not
allow; a firewall that admits only the sites' addresses removes that too. Operators
who prefer BoringSSL to refuse such peers before any byte reaches fedtrain set
``tls.verify_sites_in_handshake = true`` in server.toml: sites then need a valid
certificate for the handshake *and* the proof, and handshake refusals are again only
in gRPC's stderr line, not in audit.jsonl.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from fedtrain.errors import CertificateError, FedtrainError
from fedtrain.runtime import tls
from fedtrain.runtime.proto import fedtrain_pb2 as pb

__all__ = [
    "ClientIdentity",
    "PeerCertificate",
    "PeerRefused",
    "PeerVerifier",
    "Purpose",
    "client_identity",
    "dialled_host",
    "new_nonce",
    "transcript",
]

Purpose = Literal["join", "status"]

#: Domain separation: these signatures can never be mistaken for another use of the key.
LABEL = b"fedtrain peer-auth v1\x00"
NONCE_BYTES = 32
#: A site certificate is about 700 bytes of PEM; anything this large is not one.
MAX_CERTIFICATE_BYTES = 64 * 1024
#: Attacker-chosen names go into logs and audit records: cut them to this length.
_MAX_NAME_CHARS = 200
_MAX_MESSAGE_CHARS = 2000
_PEER_RENEW = (
    "ask the federation operator for a new site certificate "
    "(`fedtrain ca issue-site --ca-dir CA_DIR --name {name}`) and install it with the "
    "operator's ca.crt"
)


def new_nonce() -> bytes:
    """A challenge: unpredictable, so a proof made for one stream fits no other."""
    return secrets.token_bytes(NONCE_BYTES)


def transcript(purpose: Purpose, nonce: bytes, server_name: str) -> bytes:
    """What the peer signs: label, purpose, nonce and the server name it verified."""
    name = server_name.encode("utf-8")
    return b"".join((LABEL, purpose.encode(), b"\x00", len(nonce).to_bytes(2, "big"), nonce, name))


def _sign(key: PrivateKeyTypes, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _pss(), hashes.SHA256())
    raise CertificateError(
        f"a {type(key).__name__} cannot sign the server's challenge; use an EC, Ed25519 or "
        "RSA key (`fedtrain ca issue-site` writes EC P-256)"
    )


def _verify(public_key: PublicKeyTypes, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public_key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
            public_key.verify(signature, data)
        elif isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, data, _pss(), hashes.SHA256())
        else:
            return False
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        return False
    return True


def _pss() -> padding.PSS:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def _canonical_host(name: str) -> str:
    """A host name or IP address as certificates and dialled addresses compare."""
    name = name.strip().rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return name


def dialled_host(address: str) -> str:
    """The host part of a gRPC target ('fl.example.org:50051', '[::1]:50051', 'dns:///h:p')."""
    target = address.split("///", 1)[-1] if "///" in address else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        host = target
    return _canonical_host(host)


def _printable(text: str, limit: int = _MAX_NAME_CHARS) -> str:
    """Attacker-chosen text, safe for one log line: no control characters, bounded."""
    cleaned = "".join(c if c.isprintable() else "?" for c in text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


# --------------------------------------------------------------------------- peer side


@dataclass(frozen=True)
class ClientIdentity:
    """A site's (or an operator's) certificate and key: TLS credentials plus the
    answer to the server's challenge."""

    credentials: grpc.ChannelCredentials
    certificate: bytes
    key: PrivateKeyTypes

    def proof(self, purpose: Purpose, nonce: bytes, server_name: str) -> pb.Proof:
        """Sign the challenge for `server_name` (the name this peer verified the server for)."""
        server_name = _canonical_host(server_name)
        signature = _sign(self.key, transcript(purpose, nonce, server_name))
        return pb.Proof(certificate=self.certificate, signature=signature, server_name=server_name)


def client_identity(cert: tls.PathLike, key: tls.PathLike, ca: tls.PathLike) -> ClientIdentity:
    """Check this machine's site certificate (as :func:`tls.channel_credentials` does)
    and load what it needs to answer the server's challenge."""
    _, credentials = tls.checked_site_credentials(cert, key, ca)
    private_key = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    return ClientIdentity(credentials, Path(cert).read_bytes(), private_key)


# --------------------------------------------------------------------------- server side


@dataclass(frozen=True)
class PeerCertificate:
    """A certificate the federation CA issued whose key signed this stream's challenge."""

    name: str
    subject: str
    issuer: str
    fingerprint: str
    not_valid_after: dt.datetime
    pem: bytes

    def audit_fields(self) -> dict[str, Any]:
        return {"subject": self.subject, "issuer": self.issuer, "cert_sha256": self.fingerprint}


class PeerRefused(FedtrainError):
    """A peer's proof of identity was refused; `cause` is one word for the audit log,
    the message says what is wrong and what to do (it is sent to the peer)."""

    def __init__(
        self,
        message: str,
        *,
        cause: str,
        certificate: x509.Certificate | None = None,
        site: str | None = None,
    ) -> None:
        super().__init__(_printable(message, _MAX_MESSAGE_CHARS))  # it quotes the peer's names
        self.cause = cause
        self.subject = _printable(certificate.subject.rfc4514_string()) if certificate else None
        self.issuer = _printable(certificate.issuer.rfc4514_string()) if certificate else None
        self.fingerprint = certificate.fingerprint(hashes.SHA256()).hex() if certificate else None
        #: The site the certificate names, once the federation CA is known to have signed it.
        self.site = site

    def audit_fields(self) -> dict[str, Any]:
        fields = {"subject": self.subject, "issuer": self.issuer, "cert_sha256": self.fingerprint}
        return {k: v for k, v in fields.items() if v is not None}


class PeerVerifier:
    """The server's check of a :class:`pb.Proof`: CA, validity, usage, key, server name.

    `server_names` are the names and addresses in the server's own certificate (a
    proof signed for another name was made for another server).
    """

    def __init__(self, ca_path: tls.PathLike, server_names: Iterable[str]) -> None:
        self.ca_path = Path(ca_path)
        self.ca = x509.load_pem_x509_certificate(self.ca_path.read_bytes())
        self._store = Store([self.ca])
        self.server_names = frozenset(_canonical_host(n) for n in server_names)

    def verify(
        self,
        proof: pb.Proof | None,
        *,
        purpose: Purpose,
        nonce: bytes,
        now: dt.datetime | None = None,
    ) -> PeerCertificate:
        """The verified certificate, or :class:`PeerRefused` saying why not."""
        now = now or dt.datetime.now(dt.timezone.utc)
        if proof is None or not proof.certificate:
            raise PeerRefused(
                "no site certificate was presented: with TLS a site must answer the server's "
                "challenge with its certificate (fedtrain's site daemon does; check that the "
                "site runs the same fedtrain version as the server and has tls.cert/tls.key "
                "set in site.toml)",
                cause="no_certificate",
            )
        cert = self._parse(proof.certificate)
        subject = _printable(cert.subject.rfc4514_string())
        where = f"the certificate '{subject}' this site presented"
        # The key first: only then does the peer hold the certificate it shows.
        server_name = _canonical_host(proof.server_name)
        if not _verify(cert.public_key(), proof.signature, transcript(purpose, nonce, server_name)):
            raise PeerRefused(
                f"the signature over the server's challenge does not verify with the key of "
                f"{where}: the site's private key does not belong to its certificate (use "
                "the .key written together with the .crt), or the message was altered",
                cause="key_mismatch",
                certificate=cert,
            )
        renew = _PEER_RENEW.format(name=tls.site_name_of(cert) or "SITE")
        try:
            tls.verify_issued(
                cert,
                self.ca,
                purpose="site",
                where=where,
                ca_label=f"'{self.ca.subject.rfc4514_string()}'",
                foreign_fix=(
                    "use the certificate and ca.crt the federation operator issued to this "
                    f"site (this one belongs to another federation), or {renew}"
                ),
                renew=renew,
                now=now,
            )
            policy = PolicyBuilder().store(self._store).time(now).build_client_verifier()
            policy.verify(cert, [])
        except CertificateError as exc:
            cause = exc.cause or "bad_certificate"
            # Past the CA's signature (an expired certificate, say) the name is the CA's word.
            site = tls.site_name_of(cert) if cause != "foreign_ca" else None
            raise PeerRefused(str(exc), cause=cause, certificate=cert, site=site) from None
        except VerificationError as exc:
            raise PeerRefused(
                f"{where} fails RFC 5280 verification against the federation CA ({exc}); {renew}",
                cause="bad_certificate",
                certificate=cert,
            ) from None
        if server_name not in self.server_names:
            raise PeerRefused(
                f"the site proved its identity for server {_printable(server_name)!r}, but this "
                f"server's certificate names {', '.join(sorted(self.server_names))}: dial one of "
                "those names, or set tls.server_name in site.toml to one of them",
                cause="wrong_server",
                certificate=cert,
                site=tls.site_name_of(cert),
            )
        name = tls.site_name_of(cert)
        assert name is not None  # verify_issued refuses a site certificate without one
        return PeerCertificate(
            name=name,
            subject=subject,
            issuer=_printable(cert.issuer.rfc4514_string()),
            fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
            not_valid_after=cert.not_valid_after_utc,
            pem=proof.certificate,
        )

    @staticmethod
    def _parse(pem: bytes) -> x509.Certificate:
        if len(pem) > MAX_CERTIFICATE_BYTES:
            raise PeerRefused(
                f"the certificate presented is {len(pem)} bytes, more than any site "
                f"certificate ({MAX_CERTIFICATE_BYTES}); send the site's .crt file",
                cause="bad_certificate",
            )
        try:
            return x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise PeerRefused(
                f"the certificate presented is not a PEM certificate ({_printable(str(exc))}); "
                "send the site's .crt file as issued by `fedtrain ca issue-site`",
                cause="bad_certificate",
            ) from None
