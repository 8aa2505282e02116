"""Test tasks and helpers for the runtime tests.

This directory is put on sys.path (conftest.py) and on the PYTHONPATH of the server
and site processes the integration tests start, so `runtime_support:TinyTask` names
the same task, with the same fingerprint, in every process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import queue
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.config import from_dict
from fedtrain.runtime import tls, wire
from fedtrain.runtime.config import ServerConfig
from fedtrain.runtime.demo import dump_toml, fedtrain_command, free_port, tail
from fedtrain.runtime.lifecycle import ProcessGroup
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.proto import fedtrain_pb2_grpc as pb_grpc
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.strategy import RoundConfig, WeightedSum
from fedtrain.task import EvalResult, Task, TaskContext, TorchTask, TrainResult
from fedtrain.tensor_file import load_tensor_file

HERE = Path(__file__).resolve().parent


# -- tasks ------------------------------------------------------------------------------------
class TinyTask(TorchTask):
    """Logistic regression on 200 synthetic points; no download, fast to import.

    `delay_s` makes training take at least that long, so a test can act mid-round.
    """

    def __init__(self, delay_s: float = 0.0, features: int = 8) -> None:
        self.delay_s = delay_s
        self.features = features

    def model(self) -> nn.Module:
        return nn.Linear(self.features, 2)

    def datasets(self) -> tuple[Dataset, Dataset]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(260, self.features, generator=gen)
        y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
        return TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:])

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        started = time.monotonic()
        result = super().train(model, data, config, context)
        time.sleep(max(0.0, self.delay_s - (time.monotonic() - started)))
        return result


class HeldOutTask(TinyTask):
    """TinyTask whose server holds no test set: only the sites' held-out data evaluates.

    `eval_marker` (a path): the `slow_call`-th evaluation in this process creates the
    file and then takes `eval_delay_s` longer, so a test can kill a site while it
    evaluates. (A site evaluates only when the server asks: its first evaluation
    answers the server's evaluation of round 1's model.)
    """

    def __init__(
        self, eval_marker: str = "", eval_delay_s: float = 0.0, slow_call: int = 1
    ) -> None:
        super().__init__()
        self.eval_marker = eval_marker
        self.eval_delay_s = eval_delay_s
        self.slow_call = slow_call
        self.eval_calls = 0

    def datasets(self) -> tuple[Dataset, None]:  # type: ignore[override]
        return super().datasets()[0], None

    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        self.eval_calls += 1
        if self.eval_marker and self.eval_calls == self.slow_call:
            Path(self.eval_marker).touch()
            time.sleep(self.eval_delay_s)
        return super().evaluate(model, data, config, context)


class LrProbeTask(TinyTask):
    """TinyTask that reports, as training metrics, the learning rate its optimizer
    trained with and its epochs: what the round's config made of training."""

    def optimizer(self, model: nn.Module, config: RoundConfig) -> torch.optim.Optimizer:
        opt = super().optimizer(model, config)
        self.used_lr = opt.param_groups[0]["lr"]
        return opt

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        result = super().train(model, data, config, context)
        probe = {"lr_used": self.used_lr, "epochs_used": float(config.get("epochs", 1))}
        return TrainResult(result.num_examples, {**result.metrics, **probe})


class PacedTask(TinyTask):
    """TinyTask on a device of fixed speed: every training batch takes `batch_s` longer,
    so a site with 10x the pause is about 10x slower."""

    def __init__(self, batch_s: float = 0.0) -> None:
        super().__init__()
        self.batch_s = batch_s

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training, not the server's evaluation
            time.sleep(self.batch_s)
        return super().loss(output, target)


class Bf16Net(nn.Module):
    """bfloat16 weights plus an int64 buffer: dtypes numpy cannot even represent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3).to(torch.bfloat16)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(torch.bfloat16)).float()


class Bf16Task(TinyTask):
    def __init__(self) -> None:
        super().__init__(features=6)

    def model(self) -> nn.Module:
        return Bf16Net()


# -- certificates ---------------------------------------------------------------------------------
@dataclass
class Pki:
    """A federation CA with a server certificate (127.0.0.1, localhost) and one site's."""

    ca_dir: Path
    server_dir: Path
    site_dir: Path
    server_cert: Path
    server_key: Path
    site_cert: Path
    site_key: Path

    @property
    def ca_cert(self) -> Path:
        return self.ca_dir / tls.CA_CERT


def make_pki(root: Path, site: str = "hospital-a") -> Pki:
    ca_dir = root / "ca"
    tls.init_ca(ca_dir)
    server_cert, server_key = tls.issue_server(ca_dir, root / "server", ["127.0.0.1", "localhost"])
    site_cert, site_key = tls.issue_site(ca_dir, root / site, site)
    return Pki(ca_dir, root / "server", root / site, server_cert, server_key, site_cert, site_key)


def issue_site_window(
    ca_dir: Path, out_dir: Path, name: str, not_before: dt.datetime, not_after: dt.datetime
) -> tuple[Path, Path]:
    """A site certificate valid (whole days) from `not_before`: expired, not yet valid."""
    days = (not_after - not_before).days
    return tls.issue_site(ca_dir, out_dir, name, days, valid_from=not_before)


# -- the server in this process ------------------------------------------------------------------
#: Chunk size of in-process test servers: small, so every tensor spans several messages.
CHUNK = 16


def inprocess_server(
    tmp_path: Path, task: Task, sites: int = 1, *, pki: Pki | None = None, **extra: Any
) -> AggregationServer:
    """A started server for `task` on a free port, in this process (stop it); insecure
    unless `pki` is given (then its server certificate, and `allowed_sites`)."""
    raw = {
        "task": "runtime_support:TinyTask",
        "address": "127.0.0.1:0",
        "run_dir": str(tmp_path / "run"),
        "rounds": 3,
        "round_timeout_s": 30.0,
        "chunk_bytes": CHUNK,
        # No outage grace: a hand-driven FakeSite sends no heartbeats, so a grace would
        # keep every one it closes; the tests of the grace set it (test_outages.py).
        "heartbeat": {"interval_s": 0.2, "timeout_s": 10.0, "grace_s": 0.0},
        **extra,
    }
    raw["strategy"] = {
        "min_fit_clients": sites,
        "min_available_clients": sites,
        **extra.get("strategy", {}),
    }
    if pki is not None:
        tls_files = {
            "ca": str(pki.ca_cert),
            "cert": str(pki.server_cert),
            "key": str(pki.server_key),
        }
        raw["tls"] = {**tls_files, **extra.get("tls", {})}
        raw.setdefault("allowed_sites", ["hospital-a"])
    server = AggregationServer(from_dict(ServerConfig, raw), insecure=pki is None, task=task)
    server.start()
    return server


def scrape(port: int) -> dict[str, float]:
    """Prometheus samples at http://127.0.0.1:PORT/metrics as {'name{label="v"}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# -- a hand-driven site over the generated stub -------------------------------------------------
def join_message(
    name: str, fingerprint: str, capabilities: tuple[str, ...] = (), resume_token: str = ""
) -> pb.SiteMessage:
    """A site's first message on its control stream (insecure: the name is its identity)."""
    return pb.SiteMessage(
        join=pb.Join(
            site_name=name,
            task_fingerprint=fingerprint,
            protocol_version=wire.PROTOCOL_VERSION,
            capabilities=capabilities,
            resume_token=resume_token,
        )
    )


class FakeSite:
    """A site driven by the test through the generated stub: join, read, upload by hand."""

    def __init__(
        self,
        port: int,
        name: str,
        fingerprint: str,
        capabilities: tuple[str, ...] = (),
        resume_token: str = "",
    ) -> None:
        self.name = name
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=wire.channel_options(64 * 1024 * 1024)
        )
        self.stub = pb_grpc.FedtrainStub(self.channel)
        self.outbox: queue.SimpleQueue[pb.SiteMessage | None] = queue.SimpleQueue()
        self.inbox: queue.SimpleQueue[pb.ServerMessage | None] = queue.SimpleQueue()
        self.outbox.put(join_message(name, fingerprint, capabilities, resume_token))
        self.call = self.stub.Control(self._requests())
        threading.Thread(target=self._read, daemon=True).start()
        self.welcome = self.expect("welcome").welcome
        self.token = self.welcome.session_token

    def _requests(self) -> Iterator[pb.SiteMessage]:
        while (message := self.outbox.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self.call:
                self.inbox.put(message)
        except grpc.RpcError:
            pass
        self.inbox.put(None)

    def expect(self, kind: str, timeout: float = 30.0) -> pb.ServerMessage:
        message = self.inbox.get(timeout=timeout)
        assert message is not None, f"{self.name}: control stream ended while expecting {kind}"
        assert message.WhichOneof("kind") == kind, f"{self.name}: expected {kind}, got {message}"
        return message

    def heartbeat(self) -> None:
        self.outbox.put(pb.SiteMessage(heartbeat=pb.Heartbeat(sequence=1)))

    def report_error(self, server_round: int, message: str) -> None:
        self.outbox.put(pb.SiteMessage(error=pb.SiteError(round=server_round, message=message)))

    def download(self, version: str) -> tuple[pb.Manifest, list[pb.TensorChunk]]:
        pieces = list(
            self.stub.DownloadModel(pb.ModelRequest(version=version, session_token=self.token))
        )
        assert pieces[0].WhichOneof("kind") == "manifest"
        return pieces[0].manifest, [p.chunk for p in pieces[1:]]

    def upload(self, messages: list[pb.UpdateChunk]) -> pb.UploadReceipt:
        return self.stub.UploadUpdate(iter(messages), timeout=30)

    def header(self, server_round: int, num_examples: int = 10, **kw: Any) -> pb.UpdateChunk:
        return pb.UpdateChunk(
            header=pb.UploadHeader(
                round=server_round,
                session_token=kw.pop("token", self.token),
                num_examples=num_examples,
                **kw,
            )
        )

    def close(self) -> None:
        """Leave as a stopping daemon does (said, then the stream ends)."""
        self.outbox.put(pb.SiteMessage(heartbeat=pb.Heartbeat(leaving=True)))
        self.outbox.put(None)
        self.inbox_end(timeout=2.0)
        self.call.cancel()
        self.channel.close()

    def inbox_end(self, timeout: float) -> None:
        """Wait until the server ended the control stream (or `timeout`)."""
        with contextlib.suppress(queue.Empty):
            while self.inbox.get(timeout=timeout) is not None:
                pass


def chunk_messages(chunks: Iterator[Any]) -> list[pb.UpdateChunk]:
    return [pb.UpdateChunk(chunk=wire.chunk_to_proto(c)) for c in chunks]


# -- a deployment of real processes ------------------------------------------------------------
def finish_alpha_beta_round(
    server: AggregationServer, beta: FakeSite, gamma: FakeSite, version: str, da: Any, db: Any
) -> None:
    """Round 1 of a three-site test whose site alpha delivered `da` (10 examples) by
    whatever path the test exercises: beta uploads `db` (30) in one stream, gamma reports
    an error; the round's sum must be bit for bit that of two unbroken uploads."""
    beta.upload(
        [beta.header(1, num_examples=30, model_version=version), *chunk_messages(db.chunks(CHUNK))]
    )
    end_round_with_sum(server, gamma, [(da, 10.0), (db, 30.0)])


def end_round_with_sum(
    server: AggregationServer, gamma: FakeSite, folded: list[tuple[Any, float]]
) -> None:
    """The round's sum is bit for bit that of `folded` (update, weight) in that order
    (the order the uploads completed in); gamma's error then ends round 1."""
    unbroken = WeightedSum(folded[0][0].specs)
    for update, weight in folded:
        unbroken.add(update, weight)
    aggregate = server.coordinator.current.aggregate
    assert aggregate.count == len(folded)
    assert aggregate.total_weight == sum(weight for _, weight in folded)
    for name, acc in aggregate.sums.items():
        assert torch.equal(acc, unbroken.sums[name]), name
    gamma.report_error(1, "no update from gamma this round")
    assert server.wait(20) and server.coordinator.error is None


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `predicate` (test-side only) until truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Deployment:
    """A server and sites as real `fedtrain server` / `fedtrain client` processes.

    TOML files, certificates and logs live under `root`. `close()` stops everything
    and asserts that no process is left.
    """

    def __init__(self, root: Path, task: str, *, secure: bool = True, **server: Any) -> None:
        self.root = root
        self.task = task
        self.secure = secure
        self.port = free_port()
        self.run_dir = root / "run"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessGroup(term_timeout_s=10.0)
        self.pids: list[int] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        if secure:
            self.ca_dir = root / "pki" / "ca"
            tls.init_ca(self.ca_dir, days=2)
            cert, key = tls.issue_server(
                self.ca_dir, root / "pki" / "server", ["127.0.0.1"], days=1
            )
            server.setdefault("tls", {"ca": self.ca_dir / tls.CA_CERT, "cert": cert, "key": key})
        self.server_config: dict[str, Any] = {
            "task": task,
            "address": f"127.0.0.1:{self.port}",
            "run_dir": str(self.run_dir),
            "round_timeout_s": 30.0,
            "heartbeat": {"interval_s": 0.5, "timeout_s": 5.0},
            **server,
        }
        self.server_toml = root / "server.toml"
        self.server_toml.write_text(dump_toml(self.server_config))

    # -- processes --------------------------------------------------------------------------
    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        env = {**self.env, **(env or {})}
        proc = self.procs.start(name, args, log_path=self.logs / f"{name}.log", env=env)
        self.pids.append(proc.pid)

    def start_server(
        self,
        *,
        resume: bool = False,
        name: str = "server",
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`fedtrain server` (with `--resume RUN_DIR`, extra `flags`, extra `env`)."""
        args = ["server", "--config", str(self.server_toml), *flags]
        if resume:
            args += ["--resume", str(self.run_dir)]
        if not self.secure:
            args.append("--insecure")
        self._start(name, fedtrain_command(*args), env)

    def site_toml(self, name: str, *, ca_dir: Path | None = None, **site: Any) -> Path:
        config: dict[str, Any] = {
            "task": self.task,
            "server": f"127.0.0.1:{self.port}",
            "reconnect": {"min_s": 0.1, "max_s": 0.5},
            **site,
        }
        if self.secure:
            ca_dir = ca_dir or self.ca_dir
            cert, key = tls.issue_site(ca_dir, self.root / "pki" / name, name, days=1)
            # The site trusts the federation CA (it must verify the real server).
            config["tls"] = {"ca": self.ca_dir / tls.CA_CERT, "cert": cert, "key": key}
        else:
            config["name"] = name
        path = self.root / f"{name}.toml"
        path.write_text(dump_toml(config))
        return path

    def start_site(self, name: str, toml: Path | None = None, **site: Any) -> None:
        toml = toml or self.site_toml(name, **site)
        args = ["client", "--config", str(toml)]
        if not self.secure:
            args.append("--insecure")
        self._start(name, fedtrain_command(*args))

    def start_command(self, name: str, args: list[str]) -> None:
        """Start any command (e.g. a site under torchrun) as part of the deployment."""
        self._start(name, args)

    def proc(self, name: str) -> Any:
        return self.procs.procs[name]

    def wait_server(self, timeout: float, name: str = "server") -> int:
        proc = self.proc(name)
        try:
            return proc.wait(timeout)
        except Exception:
            raise AssertionError(
                f"{name} did not finish within {timeout}s:\n{tail(self.logs / f'{name}.log', 40)}"
            ) from None

    # -- files --------------------------------------------------------------------------------
    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def checkpointed(self) -> int:
        """The round of the run's checkpoint (written in the background); 0 before the first."""
        try:
            return int(load_tensor_file(self.run_dir / "checkpoint.ft")["round"])
        except FileNotFoundError:
            return 0

    def audit(self, event: str | None = None) -> list[dict[str, Any]]:
        try:
            records = read_audit(self.run_dir / "audit.jsonl")
        except json.JSONDecodeError:  # a line being written right now
            return []
        return [r for r in records if event is None or r["event"] == event]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def close(self) -> dict[str, int | None]:
        """Stop every process (SIGTERM first); their exit codes; assert none is left."""
        codes = {}
        for name in list(self.procs.procs):
            codes[name] = self.procs.stop(name)
        self.procs.close()
        assert_gone(self.pids)
        return codes

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_gone(pids: list[int]) -> None:
    """No process we started is alive (zombies do not count), nor any child of ours."""
    from process_sweep import is_resource_tracker  # tests/, on the path in pytest only

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"processes left behind: {alive}"
    children = [
        c
        for c in psutil.Process().children(recursive=True)
        if c.status() != psutil.STATUS_ZOMBIE and not is_resource_tracker(c)
    ]
    assert not children, f"child processes left behind: {children}"
