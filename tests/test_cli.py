"""The `fedtrain` command as a user runs it (a real subprocess)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

from fedtrain import cli

ROOT = Path(__file__).resolve().parents[1]


def fedtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedtrain.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_simulate_breast_cancer_from_the_cli(tmp_path):
    run = tmp_path / "bc"
    out = fedtrain(
        "simulate",
        "--config",
        str(ROOT / "simulations/breast_cancer.toml"),
        "--rounds",
        "3",
        "--run-dir",
        str(run),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "final accuracy: 0.9" in out.stdout
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["rounds"] == 3
    assert (run / "model.pt").stat().st_size > 0


BAD_CONFIGS = {
    'task = "fedtrain.examples:DigitsTask"\nroundz = 3\n': "unknown key roundz",
    'task = "fedtrain.examples:DigitsTask"\nrounds = "3"\n': "rounds = '3' should be int",
    "rounds = 3\n": "missing required key task",
    'task = "fedtrain.examples:DigitsTask"\n[partition]\nalpha = "x"\n': "partition.alpha",
}


def test_bad_config_fails_with_the_key_named(tmp_path):
    """One case as a user runs it (exit status 2, no traceback); the others through
    the same `main` in this process (a subprocess each cost ~3 s of imports)."""
    (first, message), *others = BAD_CONFIGS.items()
    path = tmp_path / "sim.toml"
    path.write_text(first)
    out = fedtrain("simulate", "--config", str(path), cwd=tmp_path)
    assert out.returncode == 2, (first, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # `main` sets up logging its way
    try:
        for text, message in others:
            path.write_text(text)
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                assert cli.main(["simulate", "--config", str(path)]) == 2, text
            assert message in stderr.getvalue()
            assert "Traceback" not in stderr.getvalue()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_report_from_the_cli(tmp_path):
    run = tmp_path / "bc"
    out = fedtrain(
        "simulate",
        "--config",
        str(ROOT / "simulations/breast_cancer.toml"),
        "--rounds",
        "2",
        "--run-dir",
        str(run),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    out = fedtrain("report", str(run), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (run / "report" / "index.html").exists()
    assert (run / "report" / "accuracy.png").stat().st_size > 5_000
    missing = fedtrain("report", str(tmp_path / "nope"), cwd=tmp_path)
    assert missing.returncode == 2 and "not a run directory" in missing.stderr


def test_status_of_an_unreachable_server_says_what_to_check(tmp_path):
    from fedtrain.runtime.demo import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = fedtrain("status", "--server", address, "--insecure", "--timeout", "5", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"no answer from the server at {address} (UNAVAILABLE" in out.stderr
    assert f"nothing listens on {address}: check that `fedtrain server` is running" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""

    with socket.socket() as silent:  # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        out = fedtrain("status", "--server", address, "--insecure", "--timeout", "1", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "(DEADLINE_EXCEEDED" in out.stderr
    assert "firewall" in out.stderr and "runs with --insecure too" in out.stderr

    out = fedtrain("status", "--server", address, cwd=tmp_path)  # neither TLS nor --insecure
    assert out.returncode == 2
    assert "needs --ca, --cert and --key" in out.stderr
    assert "fedtrain ca issue-site --ca-dir ca --name operator" in out.stderr


def _run_probed(args: list[str], cwd: Path) -> tuple[int, bool, str]:
    """(exit code, whether torch got imported, stderr) of `fedtrain ARGS`, run in a fresh
    interpreter."""
    probe = (
        "import sys\n"
        "from fedtrain.cli import main\n"
        f"code = main({args!r})\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    code, torch_loaded = out.stdout.splitlines()[-1].split()
    return int(code), torch_loaded == "True", out.stderr


def test_light_commands_never_import_torch(tmp_path):
    """Operators run these where torch's import (seconds on a busy machine) would be
    most of the time the command takes."""
    from fedtrain.runtime.demo import dump_toml, free_port

    ca, operator = tmp_path / "ca", tmp_path / "operator"
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    tls = {
        "ca": str(ca / "ca.crt"),
        "cert": str(operator / "operator.crt"),
        "key": str(operator / "operator.key"),
    }
    site_toml = tmp_path / "site.toml"
    site_toml.write_text(
        dump_toml({"task": "fedtrain.examples:DigitsTask", "server": address, "tls": tls})
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": 0.5}) + "\n")
    commands = [
        (["ca", "init", "--ca-dir", str(ca)], 0),
        (
            ["ca", "issue-site", "--ca-dir", str(ca), "--name", "operator", "--out", str(operator)],
            0,
        ),
        (["ca", "check", "--cert", tls["cert"], "--ca", tls["ca"], "--key", tls["key"]], 0),
        (["status", "--server", address, "--insecure", "--timeout", "1"], 2),
        (["status", "--config", str(site_toml), "--timeout", "1"], 2),
        (["report", str(run)], 0),
    ]
    for args, expected in commands:
        code, torch_loaded, stderr = _run_probed(args, tmp_path)
        assert code == expected, (args, stderr)
        assert not torch_loaded, f"`fedtrain {' '.join(args)}` imported torch"
        if "--config" in args:  # it read the site's server address and certificate
            assert f"no answer from the server at {address}" in stderr, stderr
