"""A peer proves its certificate at join; every refusal names its cause (peer_auth)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from runtime_support import Pki, issue_site_window

from fedtrain.runtime import tls
from fedtrain.runtime.peer_auth import (
    ClientIdentity,
    PeerRefused,
    PeerVerifier,
    client_identity,
    dialled_host,
    new_nonce,
    transcript,
)
from fedtrain.runtime.proto import fedtrain_pb2 as pb

SERVER = "127.0.0.1"
NOW = dt.datetime.now(dt.timezone.utc)


def identity(cert: Path, key: Path, ca: Path) -> ClientIdentity:
    """A client identity without the site's own start-up checks: what a rogue or
    misconfigured client can always present."""
    return ClientIdentity(
        credentials=grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()),
        certificate=cert.read_bytes(),
        key=serialization.load_pem_private_key(key.read_bytes(), password=None),
        name=None,
    )


def verifier(pki: Pki) -> PeerVerifier:
    return PeerVerifier(pki.ca_cert, ["127.0.0.1", "localhost"])


def test_a_site_that_signs_the_challenge_is_identified(pki: Pki) -> None:
    nonce = new_nonce()
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    peer = verifier(pki).verify(site.proof("join", nonce, SERVER), purpose="join", nonce=nonce)
    assert peer.name == "hospital-a"
    assert peer.subject == "CN=hospital-a"
    assert peer.issuer == "CN=fedtrain-federation-ca"
    assert peer.pem == pki.site_cert.read_bytes()
    assert (
        peer.audit_fields()["cert_sha256"]
        == tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site").fingerprint_sha256
    )


def _foreign_ca_same_name(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    tls.init_ca(tmp / "rogue-ca")  # the default CA name, another key
    return tls.issue_site(tmp / "rogue-ca", tmp / "rogue", "hospital-a")


def _foreign_ca_other_name(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    tls.init_ca(tmp / "other-ca", name="another-federation")
    return tls.issue_site(tmp / "other-ca", tmp / "other", "hospital-a")


def _expired(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    window = (NOW - dt.timedelta(days=30), NOW - dt.timedelta(days=1))
    return issue_site_window(pki.ca_dir, tmp / "old", "old-site", *window)


def _not_yet_valid(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    window = (NOW + dt.timedelta(days=1), NOW + dt.timedelta(days=30))
    return issue_site_window(pki.ca_dir, tmp / "early", "early-site", *window)


def _server_certificate(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    return pki.server_cert, pki.server_key


def _key_of_another_site(pki: Pki, tmp: Path) -> tuple[Path, Path]:
    _, other_key = tls.issue_site(pki.ca_dir, tmp / "b", "hospital-b")
    return pki.site_cert, other_key


REFUSALS: dict[str, tuple[Callable[[Pki, Path], tuple[Path, Path]], str, str]] = {
    "foreign CA, same name": (_foreign_ca_same_name, "foreign_ca", "not signed by the federation"),
    "foreign CA, other name": (_foreign_ca_other_name, "foreign_ca", "not by the federation CA"),
    "expired": (_expired, "expired", "expired on"),
    "not yet valid": (_not_yet_valid, "not_yet_valid", "is not valid until"),
    "server certificate": (_server_certificate, "wrong_key_usage", "not a site certificate"),
    "key of another site": (_key_of_another_site, "key_mismatch", "does not belong"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_certificate_is_refused_with_its_cause_and_what_to_do(
    pki: Pki, tmp_path: Path, case: str
) -> None:
    make, cause, words = REFUSALS[case]
    cert, key = make(pki, tmp_path)
    nonce = new_nonce()
    proof = identity(cert, key, pki.ca_cert).proof("join", nonce, SERVER)
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(proof, purpose="join", nonce=nonce)
    refused = info.value
    assert refused.cause == cause
    assert words in str(refused)
    presented = x509.load_pem_x509_certificate(cert.read_bytes())
    assert refused.subject == presented.subject.rfc4514_string()
    assert refused.issuer == presented.issuer.rfc4514_string()
    assert str(pki.ca_dir) not in str(refused)  # the server's paths are not the peer's business
    if cause in ("expired", "not_yet_valid"):
        assert "fedtrain ca issue-site --ca-dir CA_DIR --name" in str(refused)


def test_no_certificate_is_refused(pki: Pki) -> None:
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(None, purpose="join", nonce=new_nonce())
    assert info.value.cause == "no_certificate"
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(pb.Proof(), purpose="join", nonce=new_nonce())
    assert info.value.cause == "no_certificate"


@pytest.mark.parametrize("pem", [b"not a certificate", b"-----BEGIN CERTIFICATE-----\n" * 6000])
def test_garbage_or_huge_certificates_are_refused(pki: Pki, pem: bytes) -> None:
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(pb.Proof(certificate=pem), purpose="join", nonce=new_nonce())
    assert info.value.cause == "bad_certificate"


def test_a_proof_fits_only_its_own_challenge_purpose_and_server(pki: Pki) -> None:
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    nonce = new_nonce()
    for proof, purpose, challenge in [
        (site.proof("join", nonce, SERVER), "join", new_nonce()),  # replayed on another stream
        (site.proof("status", nonce, SERVER), "join", nonce),  # made for another purpose
    ]:
        with pytest.raises(PeerRefused) as info:
            verifier(pki).verify(proof, purpose=purpose, nonce=challenge)
        assert info.value.cause == "key_mismatch"
    relayed = site.proof("join", nonce, "fl.other-federation.org")
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(relayed, purpose="join", nonce=nonce)
    assert info.value.cause == "wrong_server"
    assert "tls.server_name" in str(info.value)
    assert transcript("join", nonce, SERVER) != transcript("status", nonce, SERVER)


def test_names_a_peer_chose_cannot_break_a_log_line(pki: Pki, tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    long_tail = [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "x" * 60)] * 8
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "evil\nFAKE LOG LINE"), *long_tail])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "evil.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "evil.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    nonce = new_nonce()
    proof = identity(tmp_path / "evil.crt", tmp_path / "evil.key", pki.ca_cert).proof(
        "join", nonce, SERVER
    )
    with pytest.raises(PeerRefused) as info:
        verifier(pki).verify(proof, purpose="join", nonce=nonce)
    assert info.value.cause == "foreign_ca"
    assert info.value.subject is not None
    assert "\n" not in info.value.subject and len(info.value.subject) <= 200
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "address, host",
    [
        ("fl.example.org:50051", "fl.example.org"),
        ("127.0.0.1:50051", "127.0.0.1"),
        ("[::1]:50051", "::1"),
        ("dns:///FL.Example.org.:443", "fl.example.org"),
        ("fl.example.org", "fl.example.org"),
    ],
)
def test_the_dialled_host_is_the_name_tls_verified(address: str, host: str) -> None:
    assert dialled_host(address) == host
