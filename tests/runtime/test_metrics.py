"""Prometheus metrics of an in-process server, scraped over HTTP while sites act on it.

Hand-driven sites make every count exact: one malformed upload, two good ones, one
model download, one site that vanishes mid-round.
"""

from __future__ import annotations

import socket

import grpc
import prometheus_client
import pytest
import torch
from runtime_support import (
    CHUNK,
    FakeSite,
    TinyTask,
    chunk_messages,
    inprocess_server,
    scrape,
    wait_for,
)

from fedtrain.errors import ConfigError
from fedtrain.runtime.demo import free_port
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState


def test_metrics_follow_rounds_rejections_and_dropouts(tmp_path, stop_after) -> None:
    task = TinyTask()
    port = free_port()
    server = inprocess_server(tmp_path, task, sites=2, rounds=2, metrics_port=port)
    stop_after.append(server)
    assert server.metrics_port == port
    assert server.metrics.registry is not prometheus_client.REGISTRY

    idle = scrape(port)
    assert idle["fedtrain_connected_sites"] == 0
    assert idle['fedtrain_phase{phase="waiting"}'] == 1
    assert idle["fedtrain_rounds_planned"] == 2
    assert idle["fedtrain_rounds_completed"] == 0
    assert idle["fedtrain_secure_aggregation"] == 0
    assert "fedtrain_eval_accuracy" not in idle  # nothing evaluated yet
    run = server.coordinator.run_id
    assert idle[f'fedtrain_run_info{{run_id="{run}",task="runtime_support:TinyTask"}}'] == 1

    fp = task_fingerprint(task)
    a, b = FakeSite(server.port, "alpha", fp), FakeSite(server.port, "beta", fp)
    stop_after += [a, b]
    first = a.expect("instruction").instruction
    b.expect("instruction")
    training = scrape(port)
    assert training["fedtrain_connected_sites"] == 2
    assert training["fedtrain_joins_total"] == 2
    assert training["fedtrain_round"] == 1 and training["fedtrain_round_attempt"] == 1
    assert training['fedtrain_phase{phase="training"}'] == 1
    assert training['fedtrain_phase{phase="waiting"}'] == 0
    assert 'fedtrain_site_last_seen_seconds{site="alpha"}' in training

    model = server.coordinator.global_model.state
    a.download(first.model_version)
    delta = ModelState({k: torch.full_like(v, 0.1) for k, v in model.items()})
    chunks = chunk_messages(delta.chunks(CHUNK))
    with pytest.raises(grpc.RpcError):  # weight 0: refused before any chunk is read
        a.upload([a.header(1, num_examples=0), *chunks])
    assert scrape(port)['fedtrain_uploads_rejected_total{code="INVALID_ARGUMENT"}'] == 1

    a.upload([a.header(1, model_version=first.model_version), *chunks])
    b.upload([b.header(1, model_version=first.model_version), *chunks])
    second = a.expect("instruction").instruction
    assert second.round == 2
    done = scrape(port)
    assert done["fedtrain_rounds_completed"] == 1
    assert done["fedtrain_round"] == 2
    assert done["fedtrain_uploads_accepted_total"] == 2
    assert done["fedtrain_received_bytes_total"] == 2 * delta.nbytes
    assert done["fedtrain_sent_bytes_total"] == model.nbytes
    assert done["fedtrain_round_duration_seconds_count"] == 1
    assert done["fedtrain_round_duration_seconds_sum"] > 0
    evaluated = server.coordinator.last_metrics
    assert done["fedtrain_eval_accuracy"] == pytest.approx(evaluated["accuracy"])
    assert done["fedtrain_eval_loss"] == pytest.approx(evaluated["loss"])
    assert done["fedtrain_dropouts_total"] == 0

    # Round 2: alpha delivers, beta vanishes; 1 of 2 needed updates fails the attempt.
    a.upload([a.header(2, model_version=second.model_version), *chunks])
    b.close()
    after = wait_for(
        lambda: (s := scrape(port))["fedtrain_round_attempts_failed_total"] == 1 and s,
        20,
        "the failed attempt to be counted",
    )
    assert after["fedtrain_dropouts_total"] == 1
    assert after["fedtrain_site_failures_total"] == 0
    wait_for(lambda: scrape(port)["fedtrain_connected_sites"] == 1, 10, "beta to be gone")


def test_a_taken_metrics_port_is_a_clear_error(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="metrics_port") as info:
            inprocess_server(tmp_path, TinyTask(), metrics_port=port)
    assert f"127.0.0.1:{port}" in str(info.value)


def test_metrics_port_must_be_a_port(tmp_path) -> None:
    with pytest.raises(ConfigError, match="metrics_port = 70000"):
        inprocess_server(tmp_path, TinyTask(), metrics_port=70000)


def test_dp_epsilon_reaches_metrics_and_tensorboard(tmp_path, stop_after) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    task = TinyTask()
    dp = {"name": "dpfedavg", "options": {"noise_multiplier": 0.1, "clip_norm": 1.0}}
    server = inprocess_server(tmp_path, task, sites=2, rounds=1, strategy=dp, tensorboard=True)
    stop_after.append(server)
    fp = task_fingerprint(task)
    sites = [FakeSite(server.port, name, fp) for name in ("alpha", "beta")]
    stop_after += sites
    model = server.coordinator.global_model.state
    delta = ModelState({k: torch.full_like(v, 0.01) for k, v in model.items()})
    for site in sites:
        version = site.expect("instruction").instruction.model_version
        site.upload([site.header(1, model_version=version), *chunk_messages(delta.chunks(CHUNK))])
    assert server.wait(30) and server.coordinator.error is None
    epsilon = server.coordinator.last_metrics["epsilon"]
    assert epsilon > 0
    server.stop()  # flushes and closes the event file
    events = EventAccumulator(str(server.run_dir.path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("privacy/epsilon")] == [
        (1, pytest.approx(epsilon, rel=1e-6))
    ]
