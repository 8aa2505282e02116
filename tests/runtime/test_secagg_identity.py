"""Secure-aggregation credentials from site certificates: what verifies and what does not."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedtrain.errors import SecAggError
from fedtrain.runtime import tls
from fedtrain.runtime.secagg_identity import (
    CertificateVerifier,
    _pack,
    _unpack,
    load_identity,
)
from fedtrain.secagg import SigningIdentity


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    tls.init_ca(tmp_path / "ca", days=30)
    return tmp_path / "ca"


def _site(ca: Path, tmp_path: Path, name: str) -> SigningIdentity:
    cert, key = tls.issue_site(ca, tmp_path / name, name, days=10)
    return load_identity(cert, key)


def test_a_site_credential_verifies_to_its_certificate_name(ca: Path, tmp_path: Path) -> None:
    identity = _site(ca, tmp_path, "hospital-a")
    verifier = CertificateVerifier.from_file(ca / tls.CA_CERT)
    peer = verifier.verify(3, identity.credential)
    assert peer.name == "hospital-a"
    assert peer.signed(identity.sign(b"statement"), b"statement")
    assert not peer.signed(identity.sign(b"statement"), b"another statement")
    # The server's view: id 3 must be the site it numbered 3.
    assert verifier.expecting({3: "hospital-a"}).verify(3, identity.credential) == peer
    with pytest.raises(SecAggError, match="secagg id 3 is 'hospital-b' this round, but its"):
        verifier.expecting({3: "hospital-b"}).verify(3, identity.credential)


def test_a_certificate_from_another_ca_is_refused(ca: Path, tmp_path: Path) -> None:
    tls.init_ca(tmp_path / "other", days=30)
    stranger = _site(tmp_path / "other", tmp_path, "hospital-a")
    verifier = CertificateVerifier.from_file(ca / tls.CA_CERT)
    with pytest.raises(SecAggError, match=r"site 5's certificate does not verify: .*federation CA"):
        verifier.verify(5, stranger.credential)


def test_an_expired_certificate_is_refused_even_once_cached(ca: Path, tmp_path: Path) -> None:
    identity = _site(ca, tmp_path, "hospital-a")
    now = dt.datetime.now(dt.timezone.utc)
    clock = [now]
    verifier = CertificateVerifier(
        x509.load_pem_x509_certificate((ca / tls.CA_CERT).read_bytes()), clock=lambda: clock[0]
    )
    verifier.verify(1, identity.credential)
    clock[0] = now + dt.timedelta(days=11)  # past the 10 days it was issued for
    with pytest.raises(
        SecAggError, match=r"certificate of site 1 \('hospital-a'\) is not valid now"
    ):
        verifier.verify(1, identity.credential)
    fresh = CertificateVerifier(verifier._ca, clock=lambda: clock[0])
    with pytest.raises(SecAggError, match=r"site 1's certificate does not verify: .* expired on"):
        fresh.verify(1, identity.credential)


def test_a_signing_key_the_certificate_did_not_endorse_is_refused(ca: Path, tmp_path: Path) -> None:
    identity = _site(ca, tmp_path, "hospital-a")
    der, endorsement, _ = _unpack(identity.credential, 3)
    other = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    verifier = CertificateVerifier.from_file(ca / tls.CA_CERT)
    with pytest.raises(SecAggError, match="not endorsed by its certificate's key"):
        verifier.verify(2, _pack(der, endorsement, other))
    with pytest.raises(SecAggError, match="malformed"):
        verifier.verify(2, identity.credential[:-1])
    with pytest.raises(SecAggError, match="malformed"):
        verifier.verify(2, b"")


def test_a_server_certificate_is_not_a_site(ca: Path, tmp_path: Path) -> None:
    cert, key = tls._issue(
        ca,
        tmp_path / "srv",
        stem="hospital-z",
        common_name="hospital-z",
        names=[x509.DNSName("hospital-z")],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1),
        not_after=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1),
    )
    verifier = CertificateVerifier.from_file(ca / tls.CA_CERT)
    with pytest.raises(SecAggError, match="not a site certificate"):
        verifier.verify(1, load_identity(cert, key).credential)
