"""server.toml: every key documented, mistakes named, TLS required unless --insecure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedtrain.config import from_dict, reference
from fedtrain.errors import ConfigError
from fedtrain.runtime.config import ServerConfig, SiteConfig
from fedtrain.runtime.server.app import AggregationServer

BASE = {"task": "fedtrain.examples:BreastCancerTask"}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"roundz": 3}, "unknown key roundz"),
        ({"strategy": {"min_fit": 2}}, "unknown key strategy.min_fit"),
        ({"rounds": 0}, "rounds must be > 0"),
        ({"chunk_bytes": 16 << 20}, "max_message_bytes"),
        ({"heartbeat": {"interval_s": 5.0, "timeout_s": 2.0}}, "heartbeat.interval_s"),
        ({"client": {"layers": [1, 2]}}, "client.layers"),
        ({"tls": {"ca": 3}}, "tls.ca"),
    ],
)
def test_bad_server_config_names_the_key(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_dict(ServerConfig, {**BASE, **extra})


def test_tls_is_required_unless_insecure(tmp_path: Path) -> None:
    config = from_dict(ServerConfig, {**BASE, "run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"tls.ca, tls.cert, tls.key not set.*--insecure"):
        AggregationServer(config)


def test_every_key_is_documented() -> None:
    for cls in (ServerConfig, SiteConfig):
        rows = reference(cls)
        assert rows and all(not row.endswith("|  |") for row in rows), cls.__name__


def test_cli_reports_config_errors_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('task = "fedtrain.examples:BreastCancerTask"\nround_timeout_s = -1\n')
    out = subprocess.run(
        [sys.executable, "-m", "fedtrain.cli", "server", "--config", str(path), "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "round_timeout_s must be > 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_example_configs_parse() -> None:
    from fedtrain.runtime.config import load_server_config, load_site_config

    root = Path(__file__).resolve().parents[2]
    server = load_server_config(root / "server" / "server.toml")
    site = load_site_config(root / "clients" / "site.toml")
    assert server.task == site.task
    assert server.allowed_sites and site.tls.cert


def test_cross_site_validation_is_refused_with_secure_aggregation() -> None:
    raw = {"task": "t:T", "secagg": True, "cross_site_validation": True}
    with pytest.raises(ConfigError, match="cross_site_validation = true cannot run with secure"):
        from_dict(ServerConfig, {**raw, "strategy": {"min_fit_clients": 2}})
