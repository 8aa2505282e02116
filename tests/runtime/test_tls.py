"""Federation CA and mutual TLS: issuing, checking, and a real gRPC handshake on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from runtime_support import Pki, issue_site_window

from fedtrain.errors import CertificateError, ConfigError, FedtrainError
from fedtrain.runtime import tls

RPC_TIMEOUT = 5.0
METHOD = "/fedtrain.test.Echo/Who"


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------- CA


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_init_ca_creates_self_signed_ca_with_private_key(tmp_path: Path) -> None:
    ca_dir = tmp_path / "nested" / "ca"
    cert_path = tls.init_ca(ca_dir, name="test-federation", days=30)

    assert cert_path == ca_dir / "ca.crt"
    key_path = ca_dir / "ca.key"
    assert _mode(key_path) == 0o600
    cert = _load(cert_path)
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "test-federation"
    cert.verify_directly_issued_by(cert)  # self-signed
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=30) <= lifetime <= dt.timedelta(days=30, minutes=10)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == cert.public_key()


def test_init_ca_refuses_to_overwrite(tmp_path: Path) -> None:
    tls.init_ca(tmp_path)
    before = (tmp_path / "ca.key").read_bytes()
    with pytest.raises(ConfigError, match="already holds a federation CA") as info:
        tls.init_ca(tmp_path)
    assert "another --ca-dir" in str(info.value)
    assert (tmp_path / "ca.key").read_bytes() == before


def test_init_ca_refuses_when_only_the_key_is_left(tmp_path: Path) -> None:
    tls.init_ca(tmp_path)
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(ConfigError, match="refusing"):
        tls.init_ca(tmp_path)


@pytest.mark.parametrize("days", [0, -1, True, 1.5])
def test_init_ca_rejects_bad_days(tmp_path: Path, days: object) -> None:
    with pytest.raises(ConfigError, match="days"):
        tls.init_ca(tmp_path, days=days)  # type: ignore[arg-type]
    assert not (tmp_path / "ca.key").exists()


def test_issue_without_ca_says_how_to_create_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fedtrain ca init --ca-dir"):
        tls.issue_site(tmp_path / "nope", tmp_path / "out", "site-1")


# --------------------------------------------------------------------------- issuing


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_issue_site_certificate(pki: Pki) -> None:
    assert pki.site_cert == pki.site_dir / "hospital-a.crt"
    assert pki.site_key == pki.site_dir / "hospital-a.key"
    assert _mode(pki.site_key) == 0o600
    assert (pki.site_dir / "ca.crt").read_bytes() == pki.ca_cert.read_bytes()
    assert not (pki.site_dir / "ca.key").exists()

    cert, ca = _load(pki.site_cert), _load(pki.ca_cert)
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hospital-a"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hospital-a"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    info = tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site", key_path=pki.site_key)
    assert info.common_name == "hospital-a"
    assert info.dns_names == ("hospital-a",)
    assert len(info.fingerprint_sha256) == 64


def test_issue_server_certificate_with_ip_and_dns_sans(pki: Pki) -> None:
    assert pki.server_cert == pki.server_dir / "server.crt"
    assert pki.server_key == pki.server_dir / "server.key"
    assert (pki.server_dir / "ca.crt").exists()
    cert = _load(pki.server_cert)
    cert.verify_directly_issued_by(_load(pki.ca_cert))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]

    info = tls.check_certificate(
        pki.server_cert, pki.ca_cert, purpose="server", key_path=pki.server_key
    )
    assert info.ip_addresses == ("127.0.0.1",)
    assert info.dns_names == ("localhost",)


def test_issue_into_ca_dir_keeps_ca_files(pki: Pki) -> None:
    ca_key = (pki.ca_dir / "ca.key").read_bytes()
    ca_crt = pki.ca_cert.read_bytes()
    tls.issue_site(pki.ca_dir, pki.ca_dir, "site-b")
    assert (pki.ca_dir / "ca.key").read_bytes() == ca_key
    assert pki.ca_cert.read_bytes() == ca_crt
    tls.check_certificate(pki.ca_dir / "site-b.crt", pki.ca_cert, purpose="site")


def test_reissue_replaces_the_pair(pki: Pki) -> None:
    old = pki.site_cert.read_bytes()
    cert, key = tls.issue_site(pki.ca_dir, pki.site_dir, "hospital-a")
    assert cert.read_bytes() != old
    tls.check_certificate(cert, pki.ca_cert, purpose="site", key_path=key)


@pytest.mark.parametrize(
    "name",
    ["", "has space", "a/b", "../etc", "x" * 65, "naïve", "ca", "CA", "server", "a\nb"],
)
def test_invalid_site_name_is_refused(pki: Pki, tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid site name"):
        tls.issue_site(pki.ca_dir, tmp_path / "out", name)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["a", "Hospital_A.north-2", "x" * 64])
def test_valid_site_names_are_accepted(name: str) -> None:
    assert tls.validate_site_name(name) == name


@pytest.mark.parametrize("hosts", [[], ["bad host"], ["-x.example"], ["a..b"]])
def test_invalid_server_hostnames_are_refused(pki: Pki, tmp_path: Path, hosts: list[str]) -> None:
    with pytest.raises(ConfigError):
        tls.issue_server(pki.ca_dir, tmp_path / "out", hosts)


def test_server_hostnames_ipv6_and_duplicates(pki: Pki, tmp_path: Path) -> None:
    cert_path, _ = tls.issue_server(
        pki.ca_dir, tmp_path / "s", ["::1", "FL.Example.org", "fl.example.org", "::1"]
    )
    info = tls.check_certificate(cert_path, pki.ca_cert, purpose="server")
    assert info.ip_addresses == ("::1",)
    assert info.dns_names == ("fl.example.org",)


# --------------------------------------------------------------------------- checking


def test_wrong_ca_with_same_name_is_detected(pki: Pki, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    tls.init_ca(other)  # same default CA name, different key
    with pytest.raises(CertificateError, match="not signed by the federation CA") as info:
        tls.check_certificate(pki.site_cert, other / "ca.crt", purpose="site")
    assert str(pki.site_cert) in str(info.value)


def test_wrong_ca_with_other_name_is_detected(pki: Pki, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    tls.init_ca(other, name="someone-else")
    with pytest.raises(CertificateError, match="not by the federation CA"):
        tls.check_certificate(pki.server_cert, other / "ca.crt", purpose="server")
    with pytest.raises(CertificateError):
        tls.channel_credentials(pki.site_cert, pki.site_key, other / "ca.crt")


def test_expired_certificate_is_detected(pki: Pki, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    cert, key = issue_site_window(
        pki.ca_dir,
        tmp_path / "old",
        "old-site",
        now - dt.timedelta(days=30),
        now - dt.timedelta(days=1),
    )
    with pytest.raises(CertificateError, match="expired on") as info:
        tls.check_certificate(cert, pki.ca_cert, purpose="site", key_path=key)
    msg = str(info.value)
    assert str(cert) in msg
    assert "valid from" in msg
    assert f"fedtrain ca issue-site --ca-dir {pki.ca_dir} --name old-site" in msg
    with pytest.raises(CertificateError, match="expired"):
        tls.channel_credentials(cert, key, pki.ca_cert)


def test_not_yet_valid_certificate_is_detected(pki: Pki, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    cert, _ = issue_site_window(
        pki.ca_dir, tmp_path / "f", "future", now + dt.timedelta(days=1), now + dt.timedelta(days=2)
    )
    with pytest.raises(CertificateError, match="not valid until"):
        tls.check_certificate(cert, pki.ca_cert, purpose="site")


def test_check_with_explicit_now(pki: Pki) -> None:
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=826)
    with pytest.raises(CertificateError, match="expired"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site", now=later)


def test_expired_server_hint_names_the_hosts(pki: Pki) -> None:
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=826)
    with pytest.raises(CertificateError, match="issue-server") as info:
        tls.check_certificate(pki.server_cert, pki.ca_cert, purpose="server", now=later)
    assert "--hostname localhost --hostname 127.0.0.1" in str(info.value)


def test_key_certificate_mismatch_is_detected(pki: Pki, tmp_path: Path) -> None:
    _, other_key = tls.issue_site(pki.ca_dir, tmp_path / "other", "hospital-b")
    with pytest.raises(CertificateError, match="does not match certificate"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site", key_path=other_key)
    with pytest.raises(CertificateError, match="does not match"):
        tls.channel_credentials(pki.site_cert, other_key, pki.ca_cert)
    with pytest.raises(CertificateError, match="does not match"):
        tls.server_credentials(pki.server_cert, pki.site_key, pki.ca_cert)


def test_purpose_mismatch_is_detected(pki: Pki) -> None:
    with pytest.raises(CertificateError, match="not a site certificate"):
        tls.check_certificate(pki.server_cert, pki.ca_cert, purpose="site")
    with pytest.raises(CertificateError, match="not a server certificate"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="server")
    with pytest.raises(CertificateError, match="CA certificate, not a"):
        tls.check_certificate(pki.ca_cert, pki.ca_cert, purpose="site")
    with pytest.raises(ConfigError, match="purpose"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="client")  # type: ignore[arg-type]


def test_leaf_given_as_ca_is_refused(pki: Pki) -> None:
    with pytest.raises(CertificateError, match="not a CA certificate"):
        tls.check_certificate(pki.site_cert, pki.server_cert, purpose="site")


def test_missing_and_garbage_files(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    with pytest.raises(CertificateError, match="does not exist") as info:
        tls.check_certificate(missing, pki.ca_cert, purpose="site")
    assert str(missing) in str(info.value)

    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(CertificateError, match="not a PEM certificate"):
        tls.check_certificate(garbage, pki.ca_cert, purpose="site")
    with pytest.raises(CertificateError, match="not a PEM private key"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site", key_path=garbage)
    with pytest.raises(CertificateError, match="not a regular file"):
        tls.check_certificate(tmp_path, pki.ca_cert, purpose="site")


def test_encrypted_key_is_refused(pki: Pki, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(pki.site_key.read_bytes(), password=None)
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(CertificateError, match="encrypted"):
        tls.check_certificate(pki.site_cert, pki.ca_cert, purpose="site", key_path=encrypted)


def test_certificate_error_is_a_fedtrain_error() -> None:
    assert issubclass(CertificateError, FedtrainError)


# --------------------------------------------------------------------------- real mTLS


def _who(request: bytes, context: grpc.ServicerContext) -> bytes:
    """The client certificate's CN as gRPC's handshake verified it ("<none>": no certificate)."""
    names = context.auth_context().get("x509_common_name", [])
    return bytes(names[0]) if names else b"<none>"


def _echo_server(
    cert: Path, key: Path, ca: Path, *, require_client_auth: bool
) -> tuple[grpc.Server, int]:
    handler = grpc.method_handlers_generic_handler(
        "fedtrain.test.Echo", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    _, creds = tls.server_credentials(cert, key, ca, require_client_auth=require_client_auth)
    port = server.add_secure_port("127.0.0.1:0", creds)
    assert port > 0
    server.start()
    return server, port


@pytest.fixture
def server_port(pki: Pki) -> Iterator[int]:
    """A server that verifies client certificates in the handshake
    (tls.verify_sites_in_handshake = true)."""
    server, port = _echo_server(
        pki.server_cert, pki.server_key, pki.ca_cert, require_client_auth=True
    )
    try:
        yield port
    finally:
        server.stop(0)


def _call(port: int, creds: grpc.ChannelCredentials) -> bytes:
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        return channel.unary_unary(METHOD)(b"", timeout=RPC_TIMEOUT)


@pytest.mark.integration
def test_mtls_site_from_federation_ca_is_identified(pki: Pki, server_port: int) -> None:
    creds = tls.channel_credentials(pki.site_cert, pki.site_key, pki.site_dir / "ca.crt")
    assert _call(server_port, creds) == b"hospital-a"


@pytest.mark.integration
def test_mtls_client_from_other_ca_is_rejected(pki: Pki, server_port: int, tmp_path: Path) -> None:
    rogue_ca = tmp_path / "rogue-ca"
    tls.init_ca(rogue_ca)  # same CA name as the real one, different key
    cert, key = tls.issue_site(rogue_ca, tmp_path / "rogue", "hospital-a")
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(),  # trusts the real server
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    with pytest.raises(grpc.RpcError) as info:
        _call(server_port, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.integration
def test_mtls_client_without_certificate_is_rejected(pki: Pki, server_port: int) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca_cert.read_bytes())
    with pytest.raises(grpc.RpcError) as info:
        _call(server_port, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.integration
def test_mtls_expired_client_is_rejected_by_server(
    pki: Pki, server_port: int, tmp_path: Path
) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    cert, key = issue_site_window(
        pki.ca_dir,
        tmp_path / "old",
        "old-site",
        now - dt.timedelta(days=30),
        now - dt.timedelta(days=1),
    )
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    with pytest.raises(grpc.RpcError) as info:
        _call(server_port, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.integration
def test_without_handshake_client_auth_grpc_does_not_ask_for_a_certificate(pki: Pki) -> None:
    # Why peer_auth exists: grpcio has no "request but do not verify" mode, so a server
    # that does not demand the certificate in the handshake never sees it (if this
    # fails, a newer grpcio hands it over and peer_auth's design can be revisited).
    server, port = _echo_server(
        pki.server_cert, pki.server_key, pki.ca_cert, require_client_auth=False
    )
    try:
        creds = tls.channel_credentials(pki.site_cert, pki.site_key, pki.ca_cert)
        assert _call(port, creds) == b"<none>"
    finally:
        server.stop(0)


@pytest.mark.integration
def test_mtls_client_rejects_server_from_other_ca(pki: Pki, tmp_path: Path) -> None:
    rogue_ca = tmp_path / "rogue-ca"
    tls.init_ca(rogue_ca)
    cert, key = tls.issue_server(rogue_ca, tmp_path / "rogue", ["127.0.0.1"])
    handler = grpc.method_handlers_generic_handler(
        "fedtrain.test.Echo", {"Who": grpc.unary_unary_rpc_method_handler(_who)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    try:
        port = server.add_secure_port(
            "127.0.0.1:0", tls.server_credentials(cert, key, rogue_ca / "ca.crt")[1]
        )
        server.start()
        creds = tls.channel_credentials(pki.site_cert, pki.site_key, pki.ca_cert)
        with pytest.raises(grpc.RpcError) as info:
            _call(port, creds)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
