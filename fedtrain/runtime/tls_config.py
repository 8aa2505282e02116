"""The `[tls]` tables of server.toml and site.toml, and where a site finds its server.

Torch-free, unlike the rest of the config schema (whose strategy, codec and secure
aggregation tables import the training stack): `fedtrain status --config site.toml`
reads only a site's server address and certificate, and answers in the time a light
command takes instead of the seconds torch's import costs on a busy machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtrain.config import from_dict, load_toml, option
from fedtrain.errors import ConfigError

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass
class TlsConfig:
    ca: str = option("", "Federation CA certificate (`ca.crt` from `fedtrain ca init`).", env=True)
    cert: str = option(
        "", "This machine's certificate (`fedtrain ca issue-server/-site`).", env=True
    )
    key: str = option("", "The private key of `cert`.", env=True)

    def require(self, where: str) -> tuple[Path, Path, Path]:
        """The three paths, or a clear error naming the missing keys."""
        missing = [k for k in ("ca", "cert", "key") if not getattr(self, k)]
        if missing:
            keys = ", ".join(f"tls.{k}" for k in missing)
            raise ConfigError(
                f"{where}: {keys} not set; mutual TLS needs the CA certificate and this "
                "machine's certificate and key (or pass --insecure for a local test)"
            )
        return Path(self.ca), Path(self.cert), Path(self.key)


@dataclass
class ServerTlsConfig(TlsConfig):
    verify_sites_in_handshake: bool = option(
        False,
        "Also demand a CA-signed site certificate in the TLS handshake: peers without one "
        "never reach fedtrain (a smaller attack surface), but those refusals are then not "
        "in audit.jsonl, only in gRPC's stderr line. Sites prove their certificate at join "
        "either way.",
    )


@dataclass
class SiteTlsConfig(TlsConfig):
    server_name: str = option(
        "",
        "Host name to expect in the server certificate, when it differs from the "
        "dialled address (e.g. dialling through a tunnel).",
    )


@dataclass(frozen=True)
class SiteServer:
    """Where a site.toml says its server is, and the certificate it dials with."""

    server: str
    tls: SiteTlsConfig


def read_site_server(path: str | Path) -> SiteServer:
    """`server` and `[tls]` of a site.toml, with the defaults `SiteConfig` has.

    Only these two keys are read and checked; the daemon checks the whole file.
    """
    raw = load_toml(path)
    server = raw.get("server", DEFAULT_ADDRESS)
    if not isinstance(server, str):
        raise ConfigError(f"{path}: server = {server!r} should be 'host:port'")
    return SiteServer(server, from_dict(SiteTlsConfig, raw.get("tls", {}), "tls"))
