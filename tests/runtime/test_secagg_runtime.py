"""Secure aggregation in the runtime: over real gRPC in-process, then as real processes.

In-process tests spy on the protocol objects to check what the server really folds
(masked, uniformly random vectors, never a site's quantized update) and that the
unmasked result is the weighted mean of what the sites put in. Integration tests run
`fedtrain server` / `fedtrain client` processes over mutual TLS and kill a site
mid-protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from runtime_support import (
    Deployment,
    FakeSite,
    HeldOutTask,
    TinyTask,
    inprocess_server,
    wait_for,
)

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError, SecAggError
from fedtrain.evaluation import EVALUATE_CAPABILITY
from fedtrain.privacy.distributed import DistributedDP
from fedtrain.runtime import tls, wire
from fedtrain.runtime.config import ServerConfig, SiteConfig
from fedtrain.runtime.demo import free_port
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.audit import read_audit
from fedtrain.runtime.server.coordinator import Coordinator
from fedtrain.runtime.server.masked_sum import MaskedSum
from fedtrain.runtime.server.sessions import instruct
from fedtrain.runtime.site.daemon import SiteDaemon
from fedtrain.secagg import (
    ConsistencyRequest,
    ConsistencySignature,
    KeysBroadcast,
    RoutedShares,
    SecAggClient,
    SecAggServer,
    ServerMessage,
    SetupRequest,
    UnmaskRequest,
    decode_message,
)
from fedtrain.secagg.quantize import Quantizer
from fedtrain.secagg.round_ids import ATTEMPTS_PER_ROUND
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.strategy import FedMedian
from fedtrain.strategy.aggregate import apply_mean_delta
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

#: 28 bits per value: quantized values are < 2^28, masked ones uniform over Z_2^32.
BITS = 28
SECAGG = {"enabled": True, "clip": 4.0, "bits": BITS, "max_clients": 8, "max_weight": 1000.0}
CLIENT = {"epochs": 1, "batch_size": 16, "lr": 0.1}


# -- in-process harness -------------------------------------------------------------------------
def _server(tmp_path: Path, task: TinyTask, sites: int, **extra: Any) -> AggregationServer:
    defaults = {
        "rounds": 1,
        "round_timeout_s": 60.0,
        "chunk_bytes": 64,  # a masked vector spans many chunks
        "client": CLIENT,
        "secagg": SECAGG,
    }
    return inprocess_server(tmp_path, task, sites, **{**defaults, **extra})


def _daemon(server: AggregationServer, task: TinyTask, name: str, part: int, **site: Any) -> Any:
    raw = {
        "task": "runtime_support:TinyTask",
        "name": name,
        "server": f"127.0.0.1:{server.port}",
        "data": {"kind": "quantity", "partition": part, "num_partitions": 3, "seed": 1},
        "reconnect": {"min_s": 0.1, "max_s": 0.5},
        **site,
    }
    daemon = SiteDaemon(from_dict(SiteConfig, raw), insecure=True, task=task)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    return daemon, thread


@pytest.fixture
def owned() -> Iterator[list[Any]]:
    """Servers, daemons (with their threads) and fake sites, stopped at the end."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, tuple):
            thing[0].stop()
            thing[1].join(10)
            assert not thing[1].is_alive()
        elif isinstance(thing, FakeSite):
            thing.close()
        else:
            thing.stop()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records each site's input (as the site sets it) and each chunk the server folds."""
    seen: dict[str, Any] = {"inputs": {}, "chunks": {}, "results": []}
    set_input, receive_chunk, finish = (
        SecAggClient.set_input,
        SecAggServer.receive_masked_chunk,
        SecAggServer.finish,
    )

    def spy_input(self: SecAggClient, update: np.ndarray, weight: float) -> None:
        seen["inputs"][self.site] = (np.array(update, dtype=np.float64), float(weight))
        set_input(self, update, weight)

    def spy_chunk(self: SecAggServer, site: int, offset: int, chunk: np.ndarray) -> bool:
        seen["chunks"].setdefault(site, []).append((offset, np.array(chunk)))
        return receive_chunk(self, site, offset, chunk)

    def spy_finish(self: SecAggServer) -> Any:
        result = finish(self)
        seen["results"].append(result)
        return result

    monkeypatch.setattr(SecAggClient, "set_input", spy_input)
    monkeypatch.setattr(SecAggServer, "receive_masked_chunk", spy_chunk)
    monkeypatch.setattr(SecAggServer, "finish", spy_finish)
    return seen


def _expected_mean(inputs: dict[int, tuple[np.ndarray, float]], clip: float) -> np.ndarray:
    total = sum(w for _, w in inputs.values())
    return sum(w * np.clip(x, -clip, clip) for x, w in inputs.values()) / total


# -- in-process tests ---------------------------------------------------------------------------
def test_server_folds_only_masked_vectors_and_unmasks_the_weighted_mean(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any]
) -> None:
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=3)
    owned.append(server)
    initial = server.coordinator.global_model.state.clone()
    for i, name in enumerate(("a", "b", "c")):
        owned.append(_daemon(server, task, name, i, require_secagg=True))
    assert server.wait(90), "the secure round did not finish"
    assert server.coordinator.error is None
    record = server.coordinator.last_metrics
    assert record["clients"] == 3 and record["dropped"] == []

    inputs, chunks = spy["inputs"], spy["chunks"]
    assert sorted(inputs) == sorted(chunks) == [1, 2, 3]
    assert len({w for _, w in inputs.values()}) == 3  # quantity skew: the weights differ
    # What the server folded for each site is its masked vector, not its quantized update:
    # quantized values are < 2^28, a masked vector is uniform over Z_2^32.
    folded = {site: np.concatenate([c for _, c in parts]) for site, parts in chunks.items()}
    for site, vector in folded.items():
        assert len(chunks[site]) > 1 and vector.shape == (203,)
        assert np.mean(vector >= 1 << BITS) > 0.8, f"site {site}'s upload looks unmasked"
    top = np.concatenate(list(folded.values())) >> 28  # 16 bins of the top 4 bits
    counts = np.bincount(top, minlength=16)
    expected = top.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 50, counts  # chi2(15): p ~ 1e-5

    # The unmasked result is the weighted mean of what the sites put in, within the bound.
    (result,) = spy["results"]
    total = sum(w for _, w in inputs.values())
    bound = result.quantizer.mean_error_bound(3, total)
    want = _expected_mean(inputs, SECAGG["clip"])
    assert result.total_weight == total
    assert np.abs(result.weighted_mean() - want).max() <= bound
    # ...and that mean, through FedAvg, is the new global model.
    layout = UpdateLayout.of(initial.specs)
    expected_model = apply_mean_delta(initial, layout.unflatten(want.astype(np.float32)))
    for name, tensor in server.coordinator.global_model.state.items():
        assert torch.allclose(tensor, expected_model[name], atol=bound + 1e-6), name
    uploads = [r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == "upload"]
    assert all(r["masked"] and r["num_examples"] == 0 for r in uploads)  # weights stay masked


def test_distributed_dp_sites_clip_weigh_one_and_noise_and_the_server_accounts(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any]
) -> None:
    task = TinyTask(features=100)
    privacy = {"noise_multiplier": 0.5, "clip_norm": 0.05, "min_survivors": 3}
    server = _server(tmp_path, task, sites=3, rounds=2, secagg={**SECAGG, "privacy": privacy})
    owned.append(server)
    for i, name in enumerate(("a", "b", "c")):
        owned.append(_daemon(server, task, name, i, require_secagg=True))
    assert server.wait(90), "the private rounds did not finish"
    assert server.coordinator.error is None

    # Every site clipped its update to clip_norm and took part with weight 1.
    inputs = spy["inputs"]  # the last round's, by secagg id
    assert sorted(inputs) == [1, 2, 3]
    for x, weight in inputs.values():
        assert weight == 1.0 and np.linalg.norm(x) <= 0.05 * (1 + 1e-6)
    # The unmasked sum is the sum of the clipped updates plus the calibrated noise.
    result = spy["results"][-1]
    assert result.total_weight == 3.0
    values, _ = result.weighted_sum()
    noise = values - sum(x for x, _ in inputs.values())
    dp = DistributedDP(0.5, 0.05, 3)
    want = dp.sum_noise_std(result.quantizer, 202, 3)
    assert want == pytest.approx(0.5 * (0.05 + result.quantizer.step * np.sqrt(202)))
    assert 0.75 < noise.std() / want < 1.25  # 202 draws: ~5% standard error
    # Epsilon per round, for the Gaussian mechanism with z = 0.5 at every site's rate 1.
    reference = dp.accountant()
    epsilons = [m["epsilon"] for m in server.run_dir.read_metrics()]
    assert epsilons == [reference.step(1.0), reference.step(1.0)]
    assert server.coordinator.last_metrics["delta"] == 1e-5


def _answer(site: FakeSite, client: SecAggClient | None = None) -> Any:
    """Read the next secagg stage message, answer it with `client`; returns (client, msg)."""
    message = site.expect("secagg").secagg
    msg = decode_message(message.payload)
    if isinstance(msg, SetupRequest):
        client = SecAggClient(msg.site)
    assert client is not None
    if not isinstance(msg, RoutedShares):
        reply = client.handle(msg)
        site.outbox.put(
            pb.SiteMessage(
                secagg=pb.SecAggMessage(
                    round=message.round, stage=message.stage, payload=reply.to_bytes()
                )
            )
        )
    return client, msg


def _two_daemons_and_a_hand_driven_site(
    tmp_path: Path, owned: list[Any], min_fit_clients: int = 2
) -> tuple[AggregationServer, FakeSite]:
    """A secure server, real daemons a and b, and site zz driven by the test. Three sites
    start the round; `min_fit_clients` updates are enough to finish it."""
    task = TinyTask(features=100)
    server = _server(tmp_path, task, sites=3, strategy={"min_fit_clients": min_fit_clients})
    owned.append(server)
    for i, name in enumerate(("a", "b")):
        owned.append(_daemon(server, task, name, i))
    return server, _hand_driven_site(server, task, owned)


def _hand_driven_site(server: AggregationServer, task: TinyTask, owned: list[Any]) -> FakeSite:
    fake = FakeSite(
        server.port, "zz", task_fingerprint(task), capabilities=("train", wire.SECAGG_CAPABILITY)
    )
    owned.append(fake)
    return fake


def _masked_upload(fake: FakeSite, instruction: pb.Instruction, vector: np.ndarray) -> None:
    header = fake.header(instruction.round, num_examples=0, model_version=instruction.model_version)
    header.header.masked = True
    chunks = wire.masked_chunks(vector, 64)
    fake.upload([header, *(pb.UpdateChunk(chunk=wire.chunk_to_proto(c)) for c in chunks)])


def _take_part(fake: FakeSite, until: str | None = None, value: float = 0.5) -> None:
    """Take part in the next secure round as an honest site: all of it, or only until
    the server asks for stage `until` (delivering the masked input first when `until`
    is UNMASK), which the caller then makes it miss by closing it."""
    instruction = fake.expect("instruction").instruction
    if until == "SETUP":
        fake.expect("secagg")
        return
    client, setup = _answer(fake)
    if until == "SHARE_KEYS":
        fake.expect("secagg")
        return
    _answer(fake, client)
    _, routed = _answer(fake, client)
    if until == "MASKED_INPUT":
        return
    client.set_input(np.full(setup.params.vector_length, value), 40.0)
    _masked_upload(fake, instruction, client.handle(routed).vector)
    if until is None:
        _answer(fake, client)


def test_truncated_masked_upload_is_taken_out_and_the_round_completes(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any]
) -> None:
    server, fake = _two_daemons_and_a_hand_driven_site(tmp_path, owned)
    instruction = fake.expect("instruction").instruction
    assert instruction.secagg
    client, setup = _answer(fake)
    assert isinstance(setup, SetupRequest) and setup.site == 3  # sorted names: a, b, zz
    _, keys = _answer(fake, client)
    assert isinstance(keys, KeysBroadcast)

    header = fake.header(1, num_examples=0, model_version=instruction.model_version)
    with pytest.raises(grpc.RpcError) as info:  # a plain update is refused in a secure round
        fake.upload([header])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "plain (unmasked) update is refused" in info.value.details()

    _, routed = _answer(fake, client)
    assert isinstance(routed, RoutedShares)
    client.set_input(np.full(setup.params.vector_length, 0.5), 40.0)
    masked = client.handle(routed)
    pieces = list(wire.masked_chunks(masked.vector, 64))
    header.header.masked = True
    half = [pb.UpdateChunk(chunk=wire.chunk_to_proto(c)) for c in pieces[: len(pieces) // 2]]
    with pytest.raises(grpc.RpcError) as info:
        fake.upload([header, *half])  # the stream ends halfway
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "stream ended early" in info.value.details()
    assert len(spy["chunks"][3]) == len(half) > 1  # those chunks were folded, then taken out
    fake.report_error(1, "upload broke")  # what a daemon does when its upload fails

    assert server.wait(90), "the round did not complete without the broken site"
    assert server.coordinator.error is None
    record = server.coordinator.last_metrics
    assert record["clients"] == 2 and record["failed"] == ["zz"]
    (result,) = spy["results"]
    assert result.included == (1, 2)
    inputs = {s: v for s, v in spy["inputs"].items() if s in (1, 2)}
    bound = result.quantizer.mean_error_bound(2, result.total_weight)
    assert np.abs(result.weighted_mean() - _expected_mean(inputs, SECAGG["clip"])).max() <= bound
    stages = [
        r for r in read_audit(server.run_dir.path / "audit.jsonl") if r["event"] == "secagg_stage"
    ]
    assert [r["stage"] for r in stages] == ["SETUP", "SHARE_KEYS", "MASKED_INPUT", "UNMASK"]
    assert stages[2]["missing"] == ["zz"] and stages[3]["missing"] == []


@pytest.mark.parametrize("stage", ["SETUP", "SHARE_KEYS", "UNMASK"])
def test_a_site_whose_control_stream_breaks_is_dropped_at_that_stage(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any], stage: str
) -> None:
    server, fake = _two_daemons_and_a_hand_driven_site(tmp_path, owned)
    _take_part(fake, until=stage)
    fake.close()

    assert server.wait(90), f"the round did not complete after a dropout at {stage}"
    assert server.coordinator.error is None
    (result,) = spy["results"]
    included = (1, 2, 3) if stage == "UNMASK" else (1, 2)  # a masked input, once in, counts
    assert result.included == included
    record = server.coordinator.last_metrics
    assert record["clients"] == len(included)
    assert record["dropped"] == ([] if stage == "UNMASK" else ["zz"])
    inputs = {s: v for s, v in spy["inputs"].items() if s in included}
    bound = result.quantizer.mean_error_bound(len(included), result.total_weight)
    assert np.abs(result.weighted_mean() - _expected_mean(inputs, SECAGG["clip"])).max() <= bound
    audit = read_audit(server.run_dir.path / "audit.jsonl")
    missing = {r["stage"]: r["missing"] for r in audit if r["event"] == "secagg_stage"}
    assert missing[stage] == ["zz"]


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """A curious server's notebook: every sum the server ever unmasks (protocol round id,
    included secagg ids) and every input a site masks (round id, site, update)."""
    book: dict[str, list[Any]] = {"sums": [], "inputs": []}
    set_input, finish = SecAggClient.set_input, SecAggServer.finish

    def note_input(self: SecAggClient, update: np.ndarray, weight: float) -> None:
        round_id = self._params.round_id if self._params is not None else None
        book["inputs"].append((round_id, self.site, np.array(update), float(weight)))
        set_input(self, update, weight)

    def note_sum(self: SecAggServer) -> Any:
        result = finish(self)
        book["sums"].append((self.params.round_id, result.included))
        return result

    monkeypatch.setattr(SecAggClient, "set_input", note_input)
    monkeypatch.setattr(SecAggServer, "finish", note_sum)
    return book


@pytest.mark.parametrize("stage", ["SETUP", "SHARE_KEYS", "MASKED_INPUT", "UNMASK"])
def test_a_curious_server_never_unmasks_two_sums_over_one_rounds_updates(
    tmp_path: Path, owned: list[Any], ledger: dict[str, list[Any]], stage: str
) -> None:
    """Every site must count (min_fit_clients = 3 of 3), so a dropout before the masked
    input makes the round run again. Were the first attempt's sum of the two others
    unmasked and thrown away, the retry's sum minus it would be the third site's update
    (the review reproduced exactly that, correlation 1.0). The server must decide before
    unmasking, and a retry must train afresh so no update is ever sent twice."""
    server, fake = _two_daemons_and_a_hand_driven_site(tmp_path, owned, min_fit_clients=3)
    _take_part(fake, until=stage)
    fake.close()  # vanishes at `stage`
    if stage != "UNMASK":  # the round runs again once zz is back
        _take_part(_hand_driven_site(server, TinyTask(features=100), owned), value=0.25)

    assert server.wait(90), f"the round did not complete after a dropout at {stage}"
    assert server.coordinator.error is None
    # One sum unmasked for the round, over all three sites: nothing to subtract it from.
    assert len(ledger["sums"]) == 1, ledger["sums"]
    assert ledger["sums"][0][1] == (1, 2, 3)
    audit = read_audit(server.run_dir.path / "audit.jsonl")
    attempts = 1 if stage == "UNMASK" else 2
    assert len([r for r in audit if r["event"] == "round_started"]) == attempts
    assert [r["included"] for r in audit if r["event"] == "secagg_unmasked"] == [["a", "b", "zz"]]
    # Every attempt trained afresh: no site masked the same update twice.
    for site in (1, 2):  # the daemons a and b
        updates = [x for _, s, x, _ in ledger["inputs"] if s == site]
        assert len(updates) == attempts
        assert all(
            not np.array_equal(u, v) for i, u in enumerate(updates) for v in updates[i + 1 :]
        )


def test_a_round_run_again_after_a_crash_never_repeats_an_update(
    tmp_path: Path, owned: list[Any], ledger: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server dies after unmasking round 2 but before the round is finalized and
    checkpointed (the strategy's finalize raises, as a crash would stop it); started
    again with `--resume`, it runs round 2 again and unmasks a second sum. That is only
    safe because every site trains afresh: no site may mask the same update twice."""
    finalize = Coordinator.finalize
    crashed: list[int] = []

    def crash_once(self: Coordinator, server_round: int, aggregate: Any) -> Any:
        if server_round == 2 and not crashed:
            crashed.append(server_round)
            raise RuntimeError("the server crashed after unmasking round 2")
        return finalize(self, server_round, aggregate)

    monkeypatch.setattr(Coordinator, "finalize", crash_once)
    task = TinyTask(features=100)
    address = f"127.0.0.1:{free_port()}"
    first = _server(tmp_path, task, sites=3, rounds=2, address=address)
    daemons = [_daemon(first, task, name, i) for i, name in enumerate(("a", "b", "c"))]
    owned.extend(daemons)
    assert first.wait(90), "the first server did not stop"
    assert isinstance(first.coordinator.error, RuntimeError)
    first.stop()
    config = from_dict(
        ServerConfig,
        {**json.loads((first.run_dir.path / "config.json").read_text()), "address": address},
    )
    second = AggregationServer(config, insecure=True, task=task, resume=True)
    second.start()
    owned.append(second)
    assert second.wait(90), "the resumed run did not finish"
    assert second.coordinator.error is None
    # Round 2's sum was unmasked twice (once per server), each time over fresh updates.
    round_two = 2 * ATTEMPTS_PER_ROUND + 1
    assert [r for r, _ in ledger["sums"]].count(round_two) == 2
    for site in (1, 2, 3):
        masked = [x for r, s, x, _ in ledger["inputs"] if r == round_two and s == site]
        assert len(masked) == 2
        assert not np.array_equal(masked[0], masked[1]), f"site {site} repeated its update"


def test_sites_round_their_updates_with_independent_randomness(
    tmp_path: Path, owned: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stochastic rounding's error averages out over n sites (~sqrt(n) * step / 2) only if
    the sites draw independently. Two daemons with the same configured seed (the
    default, 0) must still round with uncorrelated errors."""
    errors: list[np.ndarray] = []
    encode = Quantizer.encode

    def note_error(self: Quantizer, update: np.ndarray, weight: float, rng: Any) -> np.ndarray:
        out = encode(self, update, weight, rng)
        # An independent reference of what `encode` rounds: clip(x) scaled onto [0, L].
        scale = self.encode_weight(weight) * self.weight_resolution * self.levels
        exact = np.clip(np.asarray(update, np.float64), -self.clip, self.clip)
        exact = exact * scale / (2 * self.clip * self.max_weight) + self.levels / 2
        errors.append(out[:-1].astype(np.float64) - exact)
        return out

    monkeypatch.setattr(Quantizer, "encode", note_error)
    task = TinyTask(features=2000)
    server = _server(tmp_path, task, sites=2)
    owned.append(server)
    for name in ("a", "b"):
        owned.append(_daemon(server, task, name, 0, seed=0))
    assert server.wait(90), "the secure round did not finish"
    a, b = errors
    assert a.size == b.size == 4002
    assert np.all((a > -1) & (a < 1)) and abs(a.mean()) < 0.05  # unbiased, within a step
    # 4002 values: an estimate's standard error is ~0.016; shared draws give ~0.5.
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1


def test_site_requiring_secagg_refuses_a_plain_server(
    tmp_path: Path, owned: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    task = TinyTask()
    server = _server(tmp_path, task, sites=1, secagg={"enabled": False})
    owned.append(server)
    caplog.set_level(logging.INFO, logger="fedtrain.runtime.site.daemon")
    daemon, thread = _daemon(server, task, "careful", 0, require_secagg=True)
    owned.append((daemon, thread))
    wait_for(lambda: "requires secure aggregation" in caplog.text, 30, "the site's refusal")
    assert "does not run it; refusing to train for it" in caplog.text
    assert daemon.downloads == daemon.rounds_trained == 0
    assert not any(r["event"] == "upload" for r in read_audit(server.run_dir.path / "audit.jsonl"))


def test_secure_server_refuses_sites_that_cannot_mask(tmp_path: Path, owned: list[Any]) -> None:
    task = TinyTask()
    server = _server(tmp_path, task, sites=2)
    owned.append(server)
    with pytest.raises(
        AssertionError, match="does not speak the secure aggregation this server runs"
    ):
        FakeSite(server.port, "old", task_fingerprint(task))


@pytest.mark.parametrize("name", ["fedmedian", "fedtrimmedavg", "krum", "dpfedavg", "fedbuff"])
def test_strategies_that_need_every_update_or_fold_alone_are_refused_with_secagg(name: str) -> None:
    raw = {"task": "t:T", "secagg": True, "strategy": {"name": name}}
    with pytest.raises(ConfigError, match=f"'{name}' cannot run with secure aggregation"):
        from_dict(ServerConfig, raw)


def test_secagg_config_errors_name_the_key(tmp_path: Path) -> None:
    base = {"task": "t:T"}
    with pytest.raises(ConfigError, match="min_fit_clients = 1: secure aggregation needs"):
        from_dict(
            ServerConfig,
            {
                **base,
                "secagg": True,
                "strategy": {"min_fit_clients": 1, "min_available_clients": 1},
            },
        )
    with pytest.raises(ConfigError, match=r"unknown key secagg\.bitz"):
        from_dict(ServerConfig, {**base, "secagg": {"bitz": 3}})
    with pytest.raises(ConfigError, match=r"secagg\.unmask_timeout_s must be > 0"):
        from_dict(ServerConfig, {**base, "secagg": {"unmask_timeout_s": 0}})
    assert from_dict(ServerConfig, {**base, "secagg": True}).secagg.enabled
    assert not from_dict(ServerConfig, base).secagg.enabled
    # A strategy handed to the server directly is checked too.
    config = from_dict(ServerConfig, {**base, "run_dir": str(tmp_path), "secagg": True})
    with pytest.raises(ConfigError, match="'fedmedian' cannot run with secure aggregation"):
        AggregationServer(config, insecure=True, task=TinyTask(), strategy=FedMedian())


# -- in-process over mutual TLS: keys bound to certificates, the consistency check on ------------
def _mtls_federation(
    tmp_path: Path, owned: list[Any], names: tuple[str, ...], min_fit: int = 0
) -> tuple[AggregationServer, list[SiteDaemon]]:
    """An in-process server and daemons with certificates from one federation CA; rounds
    count with `min_fit` sites (default: all)."""
    ca = tmp_path / "pki" / "ca"
    tls.init_ca(ca, days=2)
    cert, key = tls.issue_server(ca, tmp_path / "pki" / "server", ["127.0.0.1"], days=1)
    task = TinyTask(features=100)
    raw = {
        "task": "runtime_support:TinyTask",
        "address": "127.0.0.1:0",
        "run_dir": str(tmp_path / "run"),
        "rounds": 1,
        "round_timeout_s": 60.0,
        "chunk_bytes": 64,
        "client": CLIENT,
        "secagg": SECAGG,
        "allowed_sites": list(names),
        "heartbeat": {"interval_s": 0.2, "timeout_s": 10.0},
        "strategy": {
            "min_fit_clients": min_fit or len(names),
            "min_available_clients": len(names),
        },
        "tls": {"ca": str(ca / tls.CA_CERT), "cert": str(cert), "key": str(key)},
    }
    server = AggregationServer(from_dict(ServerConfig, raw), task=task)
    server.start()
    owned.append(server)
    daemons = []
    for i, name in enumerate(names):
        site_cert, site_key = tls.issue_site(ca, tmp_path / "pki" / name, name, days=1)
        config = {
            "task": "runtime_support:TinyTask",
            "server": f"127.0.0.1:{server.port}",
            "data": {"kind": "quantity", "partition": i, "num_partitions": 3, "seed": 1},
            "reconnect": {"min_s": 0.1, "max_s": 0.5},
            "require_secagg": True,
            "tls": {"ca": str(ca / tls.CA_CERT), "cert": str(site_cert), "key": str(site_key)},
        }
        daemon = SiteDaemon(from_dict(SiteConfig, config), task=task)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        owned.append((daemon, thread))
        daemons.append(daemon)
    return server, daemons


def test_over_mtls_sites_sign_the_survivor_set_before_unmasking(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any]
) -> None:
    server, _ = _mtls_federation(tmp_path, owned, ("a", "b", "c"))
    assert server.wait(90), "the secure round did not finish"
    assert server.coordinator.error is None
    (result,) = spy["results"]
    assert result.included == (1, 2, 3)
    stages = [
        r["stage"]
        for r in read_audit(server.run_dir.path / "audit.jsonl")
        if r["event"] == "secagg_stage"
    ]
    assert stages == ["SETUP", "SHARE_KEYS", "MASKED_INPUT", "CONSISTENCY", "UNMASK"]


def test_over_mtls_a_site_lost_before_signing_stays_in_the_sum(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Site c fails just as it is asked to sign the survivor set: its masked input is in,
    so the others (2 of 3 holders, t = 2) remove its masks and the round completes."""
    sign = SecAggClient._consistency

    def flaky(self: SecAggClient, msg: ConsistencyRequest) -> Any:
        if self.site == 3:
            raise SecAggError("site 3: lost before signing (test)")
        return sign(self, msg)

    monkeypatch.setattr(SecAggClient, "_consistency", flaky)
    server, _ = _mtls_federation(tmp_path, owned, ("a", "b", "c"), min_fit=2)
    assert server.wait(90), "the secure round did not finish"
    assert server.coordinator.error is None
    (result,) = spy["results"]
    assert result.included == (1, 2, 3)
    audit = read_audit(server.run_dir.path / "audit.jsonl")
    missing = {r["stage"]: r["missing"] for r in audit if r["event"] == "secagg_stage"}
    assert missing == {
        "SETUP": [],
        "SHARE_KEYS": [],
        "MASKED_INPUT": [],
        "CONSISTENCY": ["c"],
        "UNMASK": [],
    }
    bound = result.quantizer.mean_error_bound(3, result.total_weight)
    mean = _expected_mean(spy["inputs"], SECAGG["clip"])
    assert np.abs(result.weighted_mean() - mean).max() <= bound


def test_over_mtls_a_site_told_another_survivor_set_refuses_to_unmask(
    tmp_path: Path, owned: list[Any], spy: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server lies to site c (id 3) through the real stage messages: site a dropped
    (to c alone), so c should reveal a's mask key. c refuses: only c signed that set."""
    send = MaskedSum.send

    def lying_send(self: MaskedSum, messages: dict[int, ServerMessage], gone: set[str]) -> None:
        msg = messages.get(3)
        if isinstance(msg, ConsistencyRequest):
            messages = {**messages, 3: dataclasses.replace(msg, survivors=(2, 3))}
        elif isinstance(msg, UnmaskRequest):
            lie = dataclasses.replace(msg, survivors=(2, 3), dropped=(1,))
            messages = {**messages, 3: lie}
        send(self, messages, gone)

    def unchecked(self: SecAggServer, msg: ConsistencySignature) -> None:
        self._signatures[msg.site] = msg.signature  # a liar does not check what it caused

    monkeypatch.setattr(MaskedSum, "send", lying_send)
    monkeypatch.setattr(SecAggServer, "_receive_signature", unchecked)
    # Rounds count with 2 sites, so c may sign a 2-site set; its refusal comes later.
    server, _ = _mtls_federation(tmp_path, owned, ("a", "b", "c"), min_fit=2)
    assert server.wait(90), "the secure round did not finish"
    audit = read_audit(server.run_dir.path / "audit.jsonl")
    (refusal,) = [r for r in audit if r["event"] == "site_error"]
    assert refusal["site"] == "c"
    assert (
        "only 1 of site 1's 3 share holders signed the survivor set I signed"
        in (refusal["message"])
    )
    # a and b, told the truth, unmask the honest sum: a's mask key never left a holder.
    (result,) = spy["results"]
    assert result.included == (1, 2, 3)
    inputs = spy["inputs"]
    bound = result.quantizer.mean_error_bound(3, result.total_weight)
    assert np.abs(result.weighted_mean() - _expected_mean(inputs, SECAGG["clip"])).max() <= bound


# -- real processes -------------------------------------------------------------------------------
def _model(dep: Deployment) -> ModelState:
    return ModelState(torch.load(dep.run_dir / "model.pt", weights_only=True))


def _stop_all(*deps: Deployment) -> None:
    """SIGTERM every process at once and let them exit; then close() only collects them
    (and checks that no child of the test is left, so every deployment must be down)."""
    for dep in deps:
        for name in dep.procs.procs:
            dep.procs.send_signal(name)
    for dep in deps:
        for proc in dep.procs.procs.values():
            proc.wait(30)
    for dep in deps:
        dep.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_mtls_secure_round_matches_the_plain_round_within_the_bound(tmp_path: Path) -> None:
    sites = ["hospital-a", "hospital-b", "hospital-c"]
    deps = {}
    with contextlib.ExitStack() as stack:
        # The same federation twice, side by side: with and without secure aggregation.
        for secure in (True, False):
            dep = stack.enter_context(
                Deployment(
                    tmp_path / ("secure" if secure else "plain"),
                    "runtime_support:TinyTask",
                    allowed_sites=sites,
                    rounds=1,
                    # One full batch per site: the same update in both federations, whatever
                    # order the fresh seed each training job draws shuffles it in.
                    client={**CLIENT, "batch_size": 200},
                    strategy={"min_fit_clients": 3, "min_available_clients": 3},
                    secagg=SECAGG if secure else {"enabled": False},
                    # Six sites and two servers share the cores: no site may miss the
                    # masked-input deadline or a heartbeat just because the machine is busy.
                    round_timeout_s=120.0,
                    heartbeat={"interval_s": 0.5, "timeout_s": 30.0},
                )
            )
            dep.start_server()
            for i, name in enumerate(sites):
                dep.start_site(
                    name,
                    require_secagg=secure,
                    data={"kind": "quantity", "partition": i, "num_partitions": 3, "seed": 1},
                )
            deps[secure] = dep
        for dep in deps.values():
            assert dep.wait_server(150) == 0, dep.log("server")
        _stop_all(*deps.values())
    for secure, dep in deps.items():
        uploads = dep.audit("upload")
        assert len(uploads) == 3 and all(r["masked"] is secure for r in uploads)
    assert "secure aggregation on" in deps[True].log("server")
    assert "TLS, sites prove their certificates at join" in deps[True].log("server")
    assert "consistency check on" in deps[True].log("server")
    stages = [r["stage"] for r in deps[True].audit("secagg_stage")]
    assert stages == ["SETUP", "SHARE_KEYS", "MASKED_INPUT", "CONSISTENCY", "UNMASK"]
    assert all(r["num_examples"] == 0 for r in deps[True].audit("upload"))  # weights masked
    # Same sites, same data, same initial model: one round differs only by quantization.
    # Bound (fedtrain.secagg.quantize): n * step / total weight, step = 2 clip max_weight / L.
    step = 2 * SECAGG["clip"] * SECAGG["max_weight"] / ((1 << BITS) - 1)
    bound = 3 * step / 200  # TinyTask's 200 training examples, split among the 3 sites
    secure_model, plain_model = _model(deps[True]), _model(deps[False])
    for name, plain in plain_model.items():
        diff = (secure_model[name].double() - plain.double()).abs().max().item()
        assert diff <= bound + 1e-6, (name, diff, bound)
    assert not secure_model.equal(plain_model)  # it really went through the quantizer


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_site_killed_after_sharing_keys_leaves_the_round_to_the_survivors(tmp_path: Path) -> None:
    with Deployment(
        tmp_path,
        "runtime_support:TinyTask",
        secure=False,
        strategy={"min_fit_clients": 2, "min_available_clients": 2},
        rounds=3,
        client=CLIENT,
        secagg=SECAGG,
    ) as dep:
        dep.start_server()
        for name in ("a", "b", "c"):
            dep.start_site(name, task_options={"delay_s": 2.0})

        def keys_shared_by_all() -> list[dict[str, Any]]:
            started = {
                r["round"] for r in dep.audit("round_started") if len(r["participants"]) == 3
            }
            return [
                r
                for r in dep.audit("secagg_stage")
                if r["stage"] == "SHARE_KEYS" and r["round"] in started and not r["missing"]
            ]

        shared = wait_for(keys_shared_by_all, 60, "a 3-site round past its key sharing")
        dep.procs.stop("c", signal.SIGKILL)  # training takes it 2 s: killed before its upload
        assert dep.wait_server(90) == 0, dep.log("server")
        _stop_all(dep)
    killed_in = shared[0]["round"]
    metrics = {r["round"]: r for r in dep.metrics()}
    assert sorted(metrics) == [1, 2, 3]
    assert metrics[killed_in]["clients"] == 2 and metrics[killed_in]["dropped"] == ["c"]
    assert metrics[killed_in]["attempts"] == 1  # finished with the survivors, no retry
    stages = {
        r["stage"]: r["missing"] for r in dep.audit("secagg_stage") if r["round"] == killed_in
    }
    assert stages["MASKED_INPUT"] == ["c"] and stages["UNMASK"] == []
    assert all(metrics[r]["clients"] == 2 for r in range(killed_in + 1, 4))
    assert "unmasked the sum of 2/3 sites" in dep.log("server")  # c's masks were removed


def test_a_site_requiring_secagg_refuses_a_plain_evaluate_from_a_secure_server(
    tmp_path: Path, owned: list[Any]
) -> None:
    """A server that runs secure aggregation but asks for a plain evaluation report (a
    lying or buggy one) gets a refusal, never the site's metrics in the clear."""
    task = HeldOutTask()
    server = _server(tmp_path, task, sites=2)  # one site connects: no round starts
    owned.append(server)
    held_out = {"kind": "quantity", "partition": 0, "num_partitions": 3, "seed": 1}
    daemon, thread = _daemon(
        server, task, "careful", 0, require_secagg=True, data={**held_out, "eval_fraction": 0.2}
    )
    owned.append((daemon, thread))
    registry = server.coordinator.registry
    session = wait_for(lambda: registry.get("careful"), 30, "the site to join")
    assert EVALUATE_CAPABILITY in session.capabilities
    version = server.coordinator.global_model.version
    instruct(session, 1, version, {}, time.time() + 30, kind=pb.EVALUATE)  # secagg unset
    audit = server.run_dir.path / "audit.jsonl"

    def refusal() -> list[dict[str, Any]]:
        return [r for r in read_audit(audit) if r["event"] == "site_error"]

    (record,) = wait_for(refusal, 30, "the site's refusal")
    assert record["site"] == "careful" and record["round"] == 1
    assert "requires secure aggregation (require_secagg = true)" in record["message"]
    assert "refusing to evaluate" in record["message"]
    assert not [r for r in read_audit(audit) if r["event"] == "evaluation_refused"]
    assert daemon.downloads == 0  # it did not even fetch the model
