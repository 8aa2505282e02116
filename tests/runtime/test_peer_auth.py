"""A peer proves its certificate at join; every refusal names its cause (peer_auth)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from runtime_support import (
    Deployment,
    Pki,
    TinyTask,
    inprocess_server,
    issue_site_window,
    wait_for,
)

from fedtrain.runtime import rpc, tls, wire
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
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.status import ServerUnreachable, fetch_status
from fedtrain.task import task_fingerprint

SERVER = "127.0.0.1"
NOW = dt.datetime.now(dt.timezone.utc)


def identity(cert: Path, key: Path, ca: Path) -> ClientIdentity:
    """A client identity without the site's own start-up checks: what a rogue or
    misconfigured client can always present."""
    return ClientIdentity(
        credentials=grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()),
        certificate=cert.read_bytes(),
        key=serialization.load_pem_private_key(key.read_bytes(), password=None),
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
    # A name counts only once the federation CA's signature on it verified.
    signed = cause in ("expired", "not_yet_valid")
    assert refused.site == (tls.site_name_of(presented) if signed else None)
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


# --------------------------------------------------------------------------- a real server


def _control(
    channel: grpc.Channel, who: ClientIdentity | None, fingerprint: str = "any"
) -> tuple[pb.ServerMessage, grpc.Call, queue.SimpleQueue[pb.SiteMessage | None]]:
    """Open Control like a site: answer the challenge (with `who`'s proof, if any);
    the server's answer (Welcome or Reject), the call and its request queue."""
    requests: queue.SimpleQueue[pb.SiteMessage | None] = queue.SimpleQueue()
    control = channel.stream_stream(
        rpc.method_path("Control"),
        request_serializer=pb.SiteMessage.SerializeToString,
        response_deserializer=pb.ServerMessage.FromString,
    )
    call = control(iter(requests.get, None), timeout=30)
    challenge = next(call)
    assert challenge.WhichOneof("kind") == "challenge"
    join = pb.Join(task_fingerprint=fingerprint, protocol_version=wire.PROTOCOL_VERSION)
    if who is not None:
        join.proof.CopyFrom(who.proof("join", challenge.challenge.nonce, SERVER))
    requests.put(pb.SiteMessage(join=join))
    return next(call), call, requests


def _join_refusal(channel: grpc.Channel, who: ClientIdentity | None) -> str:
    """The server's reason for refusing `who` at join."""
    answer, call, requests = _control(channel, who)
    requests.put(None)
    call.cancel()
    assert answer.WhichOneof("kind") == "reject", f"expected to be refused, got {answer}"
    return answer.reject.reason


def _bulk_codes(channel: grpc.Channel) -> list[grpc.StatusCode]:
    """What a download and an upload with a guessed session token get on `channel`."""
    codes = []
    download = channel.unary_stream(
        rpc.method_path("DownloadModel"),
        request_serializer=pb.ModelRequest.SerializeToString,
        response_deserializer=pb.ModelPiece.FromString,
    )
    upload = channel.stream_unary(
        rpc.method_path("UploadUpdate"),
        request_serializer=pb.UpdateChunk.SerializeToString,
        response_deserializer=pb.UploadReceipt.FromString,
    )
    header = pb.UpdateChunk(header=pb.UploadHeader(round=1, session_token="0" * 32))
    for call in (
        lambda: list(download(pb.ModelRequest(session_token="0" * 32), timeout=10)),
        lambda: upload(iter([header]), timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        codes.append(info.value.code())
    return codes


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_foreign_ca_expired_and_missing_certificates_are_refused_and_audited(
    tmp_path: Path,
) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        allowed_sites=["good"],
        strategy={"min_fit_clients": 1, "min_available_clients": 1},
        rounds=2,
    ) as dep:
        dep.start_server()
        wait_for(lambda: "serving run" in dep.log("server"), 60, "the server to listen")
        address, ca = f"127.0.0.1:{dep.port}", dep.ca_dir / tls.CA_CERT
        tls.init_ca(tmp_path / "rogue-ca")  # the federation CA's name, another key
        foreign = identity(*tls.issue_site(tmp_path / "rogue-ca", tmp_path / "f", "good"), ca)
        window = (NOW - dt.timedelta(days=30), NOW - dt.timedelta(days=1))
        expired = identity(*issue_site_window(dep.ca_dir, tmp_path / "old", "good", *window), ca)
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        cases = [
            (foreign.credentials, foreign, "not signed by the federation CA"),
            (expired.credentials, expired, "expired on"),
            (expired.credentials, expired, "expired on"),  # a retry: counted, not written
            (anonymous, None, "no site certificate was presented"),
        ]
        for credentials, who, words in cases:
            with grpc.secure_channel(address, credentials) as channel:
                reason = _join_refusal(channel, who)
                assert words in reason
                assert _bulk_codes(channel) == [
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNAUTHENTICATED,
                ]
            if who is not None:
                with pytest.raises(ServerUnreachable, match="refused to answer") as info:
                    fetch_status(address, who, timeout_s=10)
                assert words in str(info.value)
        assert "fedtrain ca issue-site --ca-dir CA_DIR --name good" in _join_refusal(
            grpc.secure_channel(address, expired.credentials), expired
        )
        dep.start_site("good")  # a valid allow-listed site still works
        assert dep.wait_server(90) == 0, dep.log("server")
        dep.close()

    assert [r["round"] for r in dep.metrics()] == [1, 2]
    assert {r["site"] for r in dep.audit("join")} == {"good"}
    joins = dep.audit("join_refused")
    by_cause = {
        cause: [r for r in joins if r["cause"] == cause] for cause in {r["cause"] for r in joins}
    }
    assert set(by_cause) == {"foreign_ca", "expired", "no_certificate"}
    assert sum(r["count"] for r in by_cause["expired"]) == 3
    assert len(by_cause["expired"]) == 2  # the first, then one record counting the other two
    for cause in ("foreign_ca", "expired"):
        first = by_cause[cause][0]
        assert first["peer"].startswith("ipv4:127.0.0.1:")
        assert first["subject"] == "CN=good" and first["count"] == 1
        assert first["issuer"] == "CN=fedtrain-federation-ca"  # the rogue CA copied the name
        assert first["reason"] and first["cert_sha256"]
    assert by_cause["foreign_ca"][0]["cert_sha256"] != by_cause["expired"][0]["cert_sha256"]
    # A foreign CA's "CN=good" is a claim; our CA's expired "CN=good" is site good.
    assert by_cause["foreign_ca"][0]["site"] is None and by_cause["expired"][0]["site"] == "good"
    statuses = dep.audit("status_refused")
    counts = {
        c: sum(r["count"] for r in statuses if r["cause"] == c) for c in ("expired", "foreign_ca")
    }
    assert counts == {"expired": 2, "foreign_ca": 1}
    requests = dep.audit("request_refused")
    assert {r["cause"] for r in requests} == {"unknown_session", "no_session"}
    assert all(r["peer"].startswith("ipv4:127.0.0.1:") for r in requests)


@pytest.mark.integration
def test_with_verify_sites_in_handshake_a_site_needs_its_certificate_twice(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    server = inprocess_server(
        tmp_path, TinyTask(), pki=pki, tls={"verify_sites_in_handshake": True}
    )
    stop_after.append(server)
    address = f"127.0.0.1:{server.port}"
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    assert fetch_status(address, site, timeout_s=10).run_id == server.coordinator.run_id
    # Without a certificate BoringSSL refuses the handshake: nothing reaches fedtrain.
    anonymous = dataclasses.replace(
        site, credentials=grpc.ssl_channel_credentials(pki.ca_cert.read_bytes())
    )
    with pytest.raises(ServerUnreachable, match="UNAVAILABLE"):
        fetch_status(address, anonymous, timeout_s=10)
    records = read_audit(server.run_dir.path / "audit.jsonl")
    assert not [r for r in records if r["event"].endswith("_refused")]  # the price of this mode


@pytest.mark.integration
def test_a_session_token_works_only_on_the_connection_that_proved_the_site(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    task = TinyTask()
    server = inprocess_server(tmp_path, task, pki=pki)
    stop_after.append(server)
    address = f"127.0.0.1:{server.port}"
    site = client_identity(pki.site_cert, pki.site_key, pki.ca_cert)
    download = pb.ModelRequest(version=server.coordinator.global_model.version)
    with grpc.secure_channel(address, site.credentials) as joined:
        welcome, call, requests = _control(joined, site, task_fingerprint(task))
        assert welcome.WhichOneof("kind") == "welcome"
        download.session_token = welcome.welcome.session_token
        method = rpc.method_path("DownloadModel")
        read = joined.unary_stream(method, response_deserializer=pb.ModelPiece.FromString)
        pieces = list(read(download.SerializeToString(), timeout=10))
        assert pieces[0].WhichOneof("kind") == "manifest"
        # The same site, even, on a second connection: the token alone is not enough.
        with grpc.secure_channel(address, site.credentials) as other:
            steal = other.unary_stream(method, response_deserializer=pb.ModelPiece.FromString)
            with pytest.raises(grpc.RpcError) as info:
                list(steal(download.SerializeToString(), timeout=10))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "another connection" in (info.value.details() or "")
        requests.put(None)
        call.cancel()
    (refused,) = read_audit(server.run_dir.path / "audit.jsonl", "request_refused")
    assert refused["cause"] == "other_connection" and refused["site"] == "hospital-a"


@pytest.mark.integration
def test_a_peer_that_never_answers_is_cut_off_and_audited(
    pki: Pki, tmp_path: Path, stop_after: list[Any]
) -> None:
    server = inprocess_server(tmp_path, TinyTask(), pki=pki)
    stop_after.append(server)
    server.servicer.peers.gate.timeout_s = 0.5
    anonymous = grpc.ssl_channel_credentials(pki.ca_cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{server.port}", anonymous) as channel:
        control = channel.stream_stream(
            rpc.method_path("Control"), response_deserializer=pb.ServerMessage.FromString
        )
        silent: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        call = control(iter(silent.get, None), timeout=30)
        assert next(call).WhichOneof("kind") == "challenge"
        (reply,) = list(call)  # at the deadline the server refuses and ends the stream
        assert reply.WhichOneof("kind") == "reject"
        assert "no answer to the server's challenge within 0.5s" in reply.reject.reason
        silent.put(None)
    wait_for(lambda: len(server.servicer.peers.gate) == 0, 10, "the gate to free the slot")
    audit = server.run_dir.path / "audit.jsonl"
    (refused,) = wait_for(lambda: read_audit(audit, "join_refused"), 10, "the refusal")
    assert refused["cause"] == "timeout" and refused["peer"].startswith("ipv4:127.0.0.1:")
