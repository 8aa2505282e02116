"""Federation certificate authority and the TLS credentials of the gRPC runtime.

Trust model: one federation CA (``fedtrain ca init``) signs one server certificate
(EKU serverAuth, SAN = every DNS name / IP address sites dial) and one certificate per
site (EKU clientAuth, CN = SAN DNS = site name). Sites verify the server's certificate
in the TLS handshake. The server verifies a site's certificate when the site proves it
holds its key at join (``fedtrain.runtime.peer_auth`` says why there and not in the
handshake), with :func:`verify_issued`, then checks the allow-list: being signed by the
CA alone does not admit a site.

Keys are EC P-256 (well supported by gRPC's BoringSSL), stored as unencrypted PKCS#8 PEM
with mode 0600. The CA key never leaves the CA directory; every issued directory gets
only a copy of ``ca.crt`` so a site has everything it needs in one folder.

Certificates are checked before credentials are built (readable, PEM, validity window,
signed by the CA, right purpose, key matches), so a misconfiguration fails at startup
with a message that says what to do instead of as an opaque handshake failure later.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    PrivateKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedtrain.errors import CertificateError, ConfigError
from fedtrain.files import atomic_write

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "SERVER_CERT",
    "SERVER_KEY",
    "SITE_NAME_RE",
    "CertificateInfo",
    "channel_credentials",
    "check_certificate",
    "checked_site_credentials",
    "init_ca",
    "issue_server",
    "issue_site",
    "server_credentials",
    "site_name_of",
    "validate_site_name",
    "verify_issued",
]

log = logging.getLogger(__name__)

Purpose = Literal["server", "site"]
PathLike = str | os.PathLike[str]

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"

#: Site names become a certificate CN/SAN and file names, so they are kept to a safe set.
SITE_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
# Stems of the files an issued directory already holds; a site with such a name
# would overwrite them (and, issued into the CA directory, the CA key itself).
_RESERVED_SITE_NAMES = frozenset({"ca", "server"})
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
# Issued certificates start slightly in the past so a peer whose clock lags a little
# does not reject a certificate that was just issued.
_CLOCK_SKEW = dt.timedelta(minutes=5)
_CA_DIR_PLACEHOLDER = "CA_DIR"
_ISSUER_KEY_TYPES = (
    ec.EllipticCurvePrivateKey,
    ed25519.Ed25519PrivateKey,
    ed448.Ed448PrivateKey,
    rsa.RSAPrivateKey,
    dsa.DSAPrivateKey,
)


@dataclass(frozen=True)
class CertificateInfo:
    """What :func:`check_certificate` verified, for logs and ``fedtrain ca check``."""

    path: Path
    purpose: Purpose
    common_name: str | None
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    not_valid_before: dt.datetime
    not_valid_after: dt.datetime
    serial_number: int
    fingerprint_sha256: str


# --------------------------------------------------------------------------- helpers


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _fmt(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or days <= 0:
        raise ConfigError(f"days must be a positive whole number of days, got {days!r}")


def validate_site_name(name: str) -> str:
    """Return ``name`` if it is usable as a site name (CN, SAN and file name), else raise."""
    if not isinstance(name, str) or SITE_NAME_RE.fullmatch(name) is None:
        raise ConfigError(
            f"invalid site name {name!r}: use 1 to 64 characters from A-Z, a-z, 0-9, "
            "'.', '_' and '-' (for example 'hospital-a')"
        )
    if name.lower() in _RESERVED_SITE_NAMES:
        raise ConfigError(
            f"invalid site name {name!r}: it is reserved because {name}.crt/{name}.key "
            "would overwrite the CA or server files; pick another name"
        )
    return name


def _server_names(hostnames: Sequence[str]) -> list[x509.GeneralName]:
    """DNS names and IP addresses for the server SAN; IPs become IPAddress entries."""
    if isinstance(hostnames, str):
        hostnames = [hostnames]
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in hostnames:
        host = str(raw).strip()
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            host = host.rstrip(".").lower()
            if len(host) > 253 or _HOSTNAME_RE.fullmatch(host) is None:
                raise ConfigError(
                    f"invalid server hostname {raw!r}: give the DNS names (e.g. "
                    "fl.example.org) and/or IP addresses (e.g. 10.0.0.5) that sites dial"
                ) from None
            key, name = f"dns:{host}", x509.DNSName(host)
        else:
            key, name = f"ip:{ip}", x509.IPAddress(ip)
        if key not in seen:
            seen.add(key)
            names.append(name)
    if not names:
        raise ConfigError(
            "a server certificate needs at least one hostname or IP address that sites "
            "dial (for example 127.0.0.1 for a local test)"
        )
    return names


def _key_pem(key: PrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _spki(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _read_bytes(path: Path, what: str) -> bytes:
    if not path.exists():
        raise CertificateError(f"{what} {path} does not exist")
    if not path.is_file():
        raise CertificateError(f"{what} {path} is not a regular file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertificateError(
            f"cannot read {what} {path}: {exc.strerror or exc}; check its owner and permissions"
        ) from exc


def _load_cert(path: Path, what: str) -> x509.Certificate:
    data = _read_bytes(path, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CertificateError(
            f"{what} {path} is not a PEM certificate ({exc}); expected a file that starts "
            "with '-----BEGIN CERTIFICATE-----'"
        ) from exc


def _load_key(path: Path, what: str) -> PrivateKeyTypes:
    data = _read_bytes(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:
        raise CertificateError(
            f"{what} {path} is encrypted; fedtrain needs an unencrypted PEM key "
            "protected by file permissions (mode 0600)"
        ) from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CertificateError(
            f"{what} {path} is not a PEM private key ({exc}); expected a file that starts "
            "with '-----BEGIN PRIVATE KEY-----'"
        ) from exc
    if os.name == "posix" and path.stat().st_mode & 0o077:
        log.warning(
            "%s %s is readable by other users (mode %o); run `chmod 600 %s`",
            what,
            path,
            path.stat().st_mode & 0o777,
            path,
        )
    return key


def _signature_hash(key: CertificateIssuerPrivateKeyTypes) -> hashes.SHA256 | None:
    # Ed25519/Ed448 sign the message directly; everything else signs a SHA-256 digest.
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return None
    return hashes.SHA256()


def _common_name(cert: x509.Certificate) -> str | None:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        return None
    value = attrs[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def _san(cert: x509.Certificate) -> tuple[tuple[str, ...], tuple[str, ...]]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return (), ()
    dns = tuple(ext.get_values_for_type(x509.DNSName))
    ips = tuple(str(ip) for ip in ext.get_values_for_type(x509.IPAddress))
    return dns, ips


def _eku(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    try:
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return set()


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _check_validity(cert: x509.Certificate, where: str, now: dt.datetime, hint: str) -> None:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    window = f"valid from {_fmt(start)} to {_fmt(end)}, now {_fmt(now)}"
    if now > end:
        raise CertificateError(
            f"{where} expired on {_fmt(end)} ({window}); {hint}", cause="expired"
        )
    if now < start:
        raise CertificateError(
            f"{where} is not valid until {_fmt(start)} ({window}); check this "
            f"machine's clock, or {hint}",
            cause="not_yet_valid",
        )


def _ca_dir_hint(ca_path: Path) -> str:
    """The --ca-dir to suggest: the CA's own directory if the CA key lives there."""
    return str(ca_path.parent) if (ca_path.parent / CA_KEY).exists() else _CA_DIR_PLACEHOLDER


def _renew_hint(purpose: Purpose, cert: x509.Certificate | None, ca_dir: str) -> str:
    if purpose == "site":
        cn = _common_name(cert) if cert is not None else None
        site = cn if cn and SITE_NAME_RE.fullmatch(cn) else "SITE"
        return (
            f"issue a new one with `fedtrain ca issue-site --ca-dir {ca_dir} --name {site}` "
            "and copy the new files to the site"
        )
    dns, ips = _san(cert) if cert is not None else ((), ())
    hosts = " ".join(f"--hostname {h}" for h in (*dns, *ips)) or "--hostname HOST"
    return f"issue a new one with `fedtrain ca issue-server --ca-dir {ca_dir} {hosts}`"


def _check_ca_cert(ca: x509.Certificate, ca_path: Path, now: dt.datetime) -> None:
    if not _is_ca(ca):
        raise CertificateError(
            f"{ca_path} is not a CA certificate (no BasicConstraints ca=True); pass the "
            f"federation CA's {CA_CERT}, created by `fedtrain ca init`"
        )
    _check_validity(
        ca,
        f"CA certificate {ca_path}",
        now,
        "create a new federation CA with `fedtrain ca init --ca-dir NEW_DIR` and re-issue "
        "the server and every site certificate from it",
    )


# --------------------------------------------------------------------------- the CA


def init_ca(directory: PathLike, name: str = "fedtrain-federation-ca", days: int = 3650) -> Path:
    """Create a new federation CA (``ca.key`` mode 0600, ``ca.crt``) and return ``ca.crt``.

    Refuses to overwrite an existing CA: every certificate it issued would stop working.
    """
    directory = Path(directory)
    _check_days(days)
    if not isinstance(name, str) or not name.strip() or len(name) > 64:
        raise ConfigError(f"invalid CA name {name!r}: use 1 to 64 characters")
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    existing = [str(p) for p in (cert_path, key_path) if p.exists()]
    if existing:
        raise ConfigError(
            f"{directory} already holds a federation CA ({', '.join(existing)}); refusing "
            "to overwrite it because every certificate it issued would stop working. Use "
            "another --ca-dir, or, to really start a new federation, delete those files "
            "yourself and re-issue the server and every site certificate"
        )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = _now() - _CLOCK_SKEW
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + _CLOCK_SKEW + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    atomic_write(key_path, lambda f: f.write(_key_pem(key)), 0o600)
    atomic_write(cert_path, lambda f: f.write(_cert_pem(cert)), 0o644)
    log.info(
        "created federation CA %r in %s (valid until %s)",
        name,
        directory,
        _fmt(cert.not_valid_after_utc),
    )
    return cert_path


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, CertificateIssuerPrivateKeyTypes]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    missing = [str(p) for p in (cert_path, key_path) if not p.is_file()]
    if missing:
        raise ConfigError(
            f"no federation CA in {ca_dir} ({', '.join(missing)} missing); pass the "
            f"directory that holds {CA_CERT} and {CA_KEY}, or create a CA with "
            f"`fedtrain ca init --ca-dir {ca_dir}`"
        )
    ca_cert = _load_cert(cert_path, "CA certificate")
    ca_key = _load_key(key_path, "CA key")
    if _spki(ca_key.public_key()) != _spki(ca_cert.public_key()):
        raise CertificateError(
            f"CA key {key_path} does not belong to CA certificate {cert_path}; restore the "
            "matching pair from your backup"
        )
    _check_ca_cert(ca_cert, cert_path, _now())
    if not isinstance(ca_key, _ISSUER_KEY_TYPES):
        raise CertificateError(
            f"CA key {key_path} is a {type(ca_key).__name__}, which cannot sign certificates"
        )
    return ca_cert, ca_key


def _issue(
    ca_dir: PathLike,
    out_dir: PathLike,
    *,
    stem: str,
    common_name: str,
    names: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> tuple[Path, Path]:
    """Sign a fresh leaf key with the CA and write ``<stem>.crt``/``<stem>.key`` + ``ca.crt``.

    Takes explicit validity dates so tests can make expired or not-yet-valid certificates.
    """
    ca_dir, out_dir = Path(ca_dir), Path(out_dir)
    ca_cert, ca_key = _load_ca(ca_dir)
    if not_after <= not_before:
        raise ConfigError(
            f"certificate validity ends ({_fmt(not_after)}) before it starts ({_fmt(not_before)})"
        )
    if not_after > ca_cert.not_valid_after_utc:
        log.warning(
            "%s certificate would outlive the CA; shortening it to end with the CA on %s",
            stem,
            _fmt(ca_cert.not_valid_after_utc),
        )
        not_after = ca_cert.not_valid_after_utc

    key = ec.generate_private_key(ec.SECP256R1())
    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key())  # type: ignore[arg-type]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(aki, critical=False)
        .sign(ca_key, _signature_hash(ca_key))
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{stem}.crt", out_dir / f"{stem}.key"
    # Key first: a crash in between leaves an orphan key, never a cert without its key.
    atomic_write(key_path, lambda f: f.write(_key_pem(key)), 0o600)
    atomic_write(cert_path, lambda f: f.write(_cert_pem(cert)), 0o644)
    ca_copy = out_dir / CA_CERT
    if not (ca_copy.exists() and ca_copy.resolve() == (ca_dir / CA_CERT).resolve()):
        atomic_write(ca_copy, lambda f: f.write(_cert_pem(ca_cert)), 0o644)
    log.info(
        "issued %s certificate %s (CN=%s, valid until %s)",
        "server" if usage == ExtendedKeyUsageOID.SERVER_AUTH else "site",
        cert_path,
        common_name,
        _fmt(not_after),
    )
    return cert_path, key_path


def _window(days: int, valid_from: dt.datetime | None = None) -> tuple[dt.datetime, dt.datetime]:
    _check_days(days)
    if valid_from is not None:
        return valid_from, valid_from + dt.timedelta(days=days)
    now = _now()
    return now - _CLOCK_SKEW, now + dt.timedelta(days=days)


def issue_server(
    ca_dir: PathLike, out_dir: PathLike, hostnames: Sequence[str], days: int = 825
) -> tuple[Path, Path]:
    """Issue ``server.crt``/``server.key`` (serverAuth) for the names/IPs sites dial.

    IP addresses (e.g. ``127.0.0.1``) become IPAddress SANs so TLS verification works
    when sites connect by IP.
    """
    names = _server_names(hostnames)
    first = names[0].value
    common_name = str(first) if len(str(first)) <= 64 else "fedtrain-server"
    not_before, not_after = _window(days)
    return _issue(
        ca_dir,
        out_dir,
        stem="server",
        common_name=common_name,
        names=names,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        not_before=not_before,
        not_after=not_after,
    )


def issue_site(
    ca_dir: PathLike,
    out_dir: PathLike,
    site_name: str,
    days: int = 825,
    *,
    valid_from: dt.datetime | None = None,
) -> tuple[Path, Path]:
    """Issue ``<site>.crt``/``<site>.key`` (clientAuth, CN = SAN DNS = site name), valid
    for `days` from now (or from `valid_from`: drills with expired certificates)."""
    validate_site_name(site_name)
    not_before, not_after = _window(days, valid_from)
    return _issue(
        ca_dir,
        out_dir,
        stem=site_name,
        common_name=site_name,
        names=[x509.DNSName(site_name)],
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        not_before=not_before,
        not_after=not_after,
    )


# --------------------------------------------------------------------------- checks


def check_certificate(
    cert_path: PathLike,
    ca_path: PathLike,
    *,
    purpose: Purpose,
    key_path: PathLike | None = None,
    now: dt.datetime | None = None,
) -> CertificateInfo:
    """Verify a server or site certificate against the federation CA, or raise.

    Checks, in order: the CA file is a valid, unexpired CA; the certificate is readable
    PEM, signed by that CA (issuer name and signature), within its validity window,
    issued for ``purpose`` (serverAuth / clientAuth with a valid site name) and, when
    ``key_path`` is given, matches its private key. Raises :class:`CertificateError`
    with the file, the dates and the command that fixes it.
    """
    if purpose not in ("server", "site"):
        raise ConfigError(f"purpose must be 'server' or 'site', got {purpose!r}")
    cert_path, ca_path = Path(cert_path), Path(ca_path)
    now = now or _now()
    what = f"{purpose} certificate"

    ca = _load_cert(ca_path, "CA certificate")
    _check_ca_cert(ca, ca_path, now)
    cert = _load_cert(cert_path, what)
    renew = _renew_hint(purpose, cert, _ca_dir_hint(ca_path))
    verify_issued(
        cert,
        ca,
        purpose=purpose,
        where=f"{what} {cert_path}",
        ca_label=f"'{ca.subject.rfc4514_string()}' ({ca_path})",
        foreign_fix=f"use the ca.crt of the CA that issued it, or {renew}",
        renew=renew,
        now=now,
    )

    if key_path is not None:
        key_path = Path(key_path)
        key = _load_key(key_path, f"{purpose} key")
        if _spki(key.public_key()) != _spki(cert.public_key()):
            raise CertificateError(
                f"{purpose} key {key_path} does not match certificate {cert_path} (they "
                f"come from different issues); use the .key written together with the "
                f".crt, or {renew}",
                cause="key_mismatch",
            )

    dns, ips = _san(cert)
    return CertificateInfo(
        path=cert_path,
        purpose=purpose,
        common_name=_common_name(cert),
        dns_names=dns,
        ip_addresses=ips,
        not_valid_before=cert.not_valid_before_utc,
        not_valid_after=cert.not_valid_after_utc,
        serial_number=cert.serial_number,
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(),
    )


def verify_issued(
    cert: x509.Certificate,
    ca: x509.Certificate,
    *,
    purpose: Purpose,
    where: str,
    ca_label: str,
    foreign_fix: str,
    renew: str,
    now: dt.datetime,
) -> None:
    """Raise :class:`CertificateError` (with its ``cause``) unless ``cert`` is a
    ``purpose`` certificate that ``ca`` issued and that is valid at ``now``.

    Shared by the start-up check of this machine's own files (:func:`check_certificate`)
    and the server's check of the certificate a peer presents (``peer_auth``), so both
    name a problem the same way. ``where`` names the certificate in the message,
    ``foreign_fix`` says what to do about one from another CA, ``renew`` about the rest.
    """
    if cert.issuer != ca.subject:
        raise CertificateError(
            f"{where} was issued by '{cert.issuer.rfc4514_string()}', not by the federation "
            f"CA {ca_label}; {foreign_fix}",
            cause="foreign_ca",
        )
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise CertificateError(
            f"{where} is not signed by the federation CA {ca_label} (the signature does not "
            "verify with the CA's key: it comes from a different CA with the same name); "
            f"{foreign_fix}",
            cause="foreign_ca",
        ) from exc
    if _is_ca(cert):
        raise CertificateError(
            f"{where} is a CA certificate, not a {purpose} certificate; {renew}",
            cause="wrong_key_usage",
        )
    _check_validity(cert, where, now, renew)

    common_name = _common_name(cert)
    dns, ips = _san(cert)
    usages = _eku(cert)
    if purpose == "server":
        if ExtendedKeyUsageOID.SERVER_AUTH not in usages:
            raise CertificateError(
                f"{where} is not a server certificate: it has no serverAuth extended key "
                f"usage; {renew}",
                cause="wrong_key_usage",
            )
        if not dns and not ips:
            raise CertificateError(
                f"{where} names no host (no subjectAltName), so no site can verify it; {renew}",
                cause="bad_certificate",
            )
        return
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usages:
        raise CertificateError(
            f"{where} is not a site certificate: it has no clientAuth extended key usage; {renew}",
            cause="wrong_key_usage",
        )
    if common_name is None or SITE_NAME_RE.fullmatch(common_name) is None:
        raise CertificateError(
            f"{where} has no valid site name in its common name (CN={common_name!r}); {renew}",
            cause="bad_certificate",
        )
    if dns and common_name not in dns:
        raise CertificateError(
            f"{where} has CN={common_name!r} but subjectAltName {list(dns)}; they must name "
            f"the same site; {renew}",
            cause="bad_certificate",
        )


# --------------------------------------------------------------------------- gRPC


def server_credentials(
    cert: PathLike, key: PathLike, ca_cert: PathLike, *, require_client_auth: bool = False
) -> tuple[CertificateInfo, grpc.ServerCredentials]:
    """TLS server credentials, and what :func:`check_certificate` found in ``cert``.

    The handshake authenticates the server; sites prove who they are at join
    (``peer_auth``), where a refusal can be audited. ``require_client_auth=True`` also
    has BoringSSL demand a CA-signed client certificate in the handshake (refusals
    there never reach the application). The files are checked first so a bad setup
    fails here, not at the first handshake.
    """
    info = check_certificate(cert, ca_cert, purpose="server", key_path=key)
    log.info(
        "server TLS: %s for %s, valid until %s",
        info.path,
        ", ".join((*info.dns_names, *info.ip_addresses)),
        _fmt(info.not_valid_after),
    )
    credentials = grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=Path(ca_cert).read_bytes(),
        require_client_auth=require_client_auth,
    )
    return info, credentials


def channel_credentials(
    cert: PathLike, key: PathLike, ca_cert: PathLike
) -> grpc.ChannelCredentials:
    """TLS channel credentials for a site: trust only the CA, present the site's certificate.

    The server verifies the site with its proof at join (``peer_auth``); the certificate
    in the handshake is only asked for by a server with ``tls.verify_sites_in_handshake``.
    """
    return checked_site_credentials(cert, key, ca_cert)[1]


def checked_site_credentials(
    cert: PathLike, key: PathLike, ca_cert: PathLike
) -> tuple[CertificateInfo, grpc.ChannelCredentials]:
    """:func:`channel_credentials` and what :func:`check_certificate` found."""
    info = check_certificate(cert, ca_cert, purpose="site", key_path=key)
    log.info(
        "site TLS: %s as %r, valid until %s",
        info.path,
        info.common_name,
        _fmt(info.not_valid_after),
    )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca_cert).read_bytes(),
        private_key=Path(key).read_bytes(),
        certificate_chain=Path(cert).read_bytes(),
    )
    return info, credentials


def site_name_of(cert: x509.Certificate) -> str | None:
    """The site a certificate names (CN, agreeing with its SAN DNS names), or None."""
    return _pick_site_name(_common_name(cert), _san(cert)[0])


def _pick_site_name(common_name: str | None, dns: Sequence[str]) -> str | None:
    """CN and SAN DNS must agree (issue_site writes both); return the valid name or None."""
    if common_name is not None:
        if SITE_NAME_RE.fullmatch(common_name) is None:
            return None
        return common_name if not dns or common_name in dns else None
    valid = [n for n in dns if SITE_NAME_RE.fullmatch(n)]
    return valid[0] if len(valid) == 1 and len(dns) == 1 else None
