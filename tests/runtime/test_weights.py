"""The weight policy: caps, the ratio to the other sites' weights, refuse or clip.

On its own, each decision is checked against a reference written independently here
(a replay of the documented rules with `statistics.median`) over random sequences of
uploads. In the server, a rogue site speaking the generated stub declares 2^64 - 1
examples for a zero update, and the global model must be the honest sites' FedAvg.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_support import CHUNK, FakeSite, TinyTask, chunk_messages, inprocess_server
from test_servicer import _audit, _download

from fedtrain.config import from_dict
from fedtrain.errors import ConfigError
from fedtrain.runtime.config import ServerConfig, WeightsConfig
from fedtrain.runtime.proto import fedtrain_pb2 as pb
from fedtrain.runtime.server.app import AggregationServer
from fedtrain.runtime.server.weights import Rule, WeightPolicy, WeightRefused
from fedtrain.task import task_fingerprint
from fedtrain.tensors import ModelState

SITES = ("a", "b", "c", "d")
U64_MAX = 2**64 - 1


def policy(**options: Any) -> WeightPolicy:
    return WeightPolicy(from_dict(WeightsConfig, options))


def reference_limit(config: WeightsConfig, site: str, latest: dict[str, int]) -> int:
    """The documented limit, computed without the policy's code."""
    if site in config.sites:
        return config.sites[site]
    others = [w for s, w in latest.items() if s != site]
    limit = config.max_num_examples
    if config.max_weight_ratio and others:
        limit = min(limit, max(1, math.floor(config.max_weight_ratio * statistics.median(others))))
    return limit


uploads = st.lists(
    st.tuples(
        st.sampled_from(SITES),
        st.one_of(st.integers(1, 5_000), st.integers(1, U64_MAX)),
    ),
    max_size=30,
)
configs = st.fixed_dictionaries(
    {
        "max_num_examples": st.integers(1, 10**12),
        "max_weight_ratio": st.sampled_from([0.0, 1.0, 2.5, 10.0, 1000.0]),
        "action": st.sampled_from(["refuse", "clip"]),
        "sites": st.dictionaries(st.sampled_from(SITES[:2]), st.integers(1, 10**6), max_size=2),
    }
)


@settings(max_examples=300, deadline=None)
@given(options=configs, sequence=uploads)
def test_every_decision_follows_the_documented_rules(options, sequence) -> None:
    config = from_dict(WeightsConfig, options)
    weights = WeightPolicy(config)
    latest: dict[str, int] = {}  # what the reference remembers: weights let through
    for site, declared in sequence:
        limit = reference_limit(config, site, latest)
        if declared > limit and config.action == "refuse":
            with pytest.raises(WeightRefused) as info:
                weights.admit(site, declared)
            refused = info.value.decision
            assert (refused.declared, refused.limit) == (declared, limit)
            assert "refused" in str(info.value) and str(limit) in str(info.value)
            continue  # a refused weight is no reference for anyone
        decision = weights.admit(site, declared)
        assert decision.limit == limit
        assert decision.weight == min(declared, limit) >= 1
        assert decision.over == (declared > limit)
        assert bool(decision.reason) == decision.over
        latest[site] = decision.weight


def test_the_ratio_uses_the_median_of_the_other_sites_latest_weights() -> None:
    weights = policy(max_weight_ratio=10)
    assert weights.admit("a", 100).weight == 100  # no reference yet: the cap alone
    assert weights.admit("b", 300).limit == 1_000  # 10 x a's 100
    assert weights.admit("c", 2_000).limit == 2_000  # 10 x median(100, 300)
    with pytest.raises(WeightRefused) as info:
        weights.admit("d", U64_MAX)
    decision = info.value.decision
    assert (decision.rule, decision.limit) == (Rule.MAX_WEIGHT_RATIO, 3_000)
    assert "median of the other sites' latest weights (300, over 3 site(s))" in decision.reason
    # a site's own history never limits it; the others' latest weights do
    assert weights.admit("a", 3_000).limit == 11_500  # 10 x median(300, 2000)


def test_a_site_with_its_own_cap_is_held_to_that_cap_alone() -> None:
    weights = policy(max_num_examples=50, sites={"big": 100_000})
    weights.admit("small", 10)
    assert weights.admit("big", 90_000).rule is Rule.SITE_CAP  # no ratio for it
    with pytest.raises(WeightRefused, match=r"at most 100000 examples \(weights.sites"):
        weights.admit("big", 100_001)
    with pytest.raises(WeightRefused, match=r"at most 50 examples \(weights.max_num_examples"):
        weights.admit("other", 51)


def test_clip_counts_the_weight_at_its_limit_and_says_so() -> None:
    weights = policy(action="clip", max_num_examples=1_000)
    decision = weights.admit("rogue", U64_MAX)
    assert (decision.weight, decision.rule, decision.over) == (1_000, Rule.MAX_NUM_EXAMPLES, True)
    assert f"num_examples = {U64_MAX} was counted as 1000" in decision.reason
    assert weights.admit("a", 2_000).limit == 1_000  # the clipped weight is the reference


@pytest.mark.parametrize(
    ("weights", "extra", "match"),
    [
        ({"max_num_examples": 0}, {}, "weights.max_num_examples must be >= 1"),
        ({"max_weight_ratio": 0.5}, {}, "weights.max_weight_ratio = 0.5 must be >= 1"),
        ({"sites": {"a": 0}}, {}, "weights.sites.a = 0 must be >= 1"),
        ({"action": "warn"}, {}, "weights.action = 'warn' should be one of"),
        ({"sites": {"hospitl-a": 5}}, {"allowed_sites": ["hospital-a"]}, "'hospitl-a', not in"),
        ({"sites": {"a": 5}}, {"secagg": True}, "cannot be enforced under secure aggregation"),
    ],
)
def test_bad_weight_policies_are_refused_naming_the_key(weights, extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        from_dict(
            ServerConfig,
            {"task": "fedtrain.examples:BreastCancerTask", "weights": weights, **extra},
        )


# -- in the server: a rogue site driving the generated stub -----------------------------------
def _delta(site: FakeSite, version: str, seed: int, scale: float = 1.0) -> ModelState:
    gen = torch.Generator().manual_seed(seed)
    model = _download(site, version)
    return ModelState({k: scale * torch.randn(v.shape, generator=gen) for k, v in model.items()})


def _send(site: FakeSite, job: pb.Instruction, delta: ModelState, n: int) -> pb.UploadReceipt:
    header = site.header(job.round, num_examples=n, model_version=job.model_version)
    return site.upload([header, *chunk_messages(delta.chunks(CHUNK))])


def _honest_two_and_a_rogue(
    server: AggregationServer, task: TinyTask, stop_after: list[Any]
) -> tuple[FakeSite, FakeSite, FakeSite, dict[str, pb.Instruction]]:
    """Sites a, b and rogue joined, and the instruction each was sent."""
    fp = task_fingerprint(task)
    sites = [FakeSite(server.port, name, fp) for name in ("a", "b", "rogue")]
    stop_after += sites
    jobs = {site.name: site.expect("instruction").instruction for site in sites}
    return sites[0], sites[1], sites[2], jobs


def _fedavg(base: ModelState, updates: list[tuple[int, ModelState]]) -> dict[str, torch.Tensor]:
    """base + sum n_i delta_i / sum n_i, in float64 (independent of the server's code)."""
    total = sum(n for n, _ in updates)
    return {
        name: (
            tensor.double() + sum(n * delta[name].double() for n, delta in updates) / total
        ).float()
        for name, tensor in base.items()
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["refuse", "clip"])
def test_a_rogue_sites_absurd_weight_cannot_take_over_a_round(tmp_path, stop_after, action) -> None:
    task = TinyTask()
    server = inprocess_server(
        tmp_path,
        task,
        sites=3,
        rounds=1,
        strategy={"min_fit_clients": 2},
        weights={"action": action, "max_weight_ratio": 10},
    )
    stop_after.append(server)
    a, b, rogue, jobs = _honest_two_and_a_rogue(server, task, stop_after)
    base = server.coordinator.global_model.state.clone()
    da, db = _delta(a, "", 1), _delta(b, "", 2)
    zero = ModelState({k: torch.zeros_like(v) for k, v in da.items()})
    _send(a, jobs["a"], da, 100)
    _send(b, jobs["b"], db, 300)
    # The rogue, authenticated like any site, declares 2^64 - 1 examples for a zero update.
    if action == "refuse":
        with pytest.raises(grpc.RpcError) as info:
            _send(rogue, jobs["rogue"], zero, U64_MAX)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert f"num_examples = {U64_MAX} refused" in info.value.details()
        assert "weights.max_weight_ratio" in info.value.details()
        rogue.report_error(1, info.value.details())  # as a site daemon does
        expected = _fedavg(base, [(100, da), (300, db)])
    else:
        receipt = _send(rogue, jobs["rogue"], zero, U64_MAX)
        assert receipt.num_examples_counted == 2_000  # 10 x median(100, 300)
        assert f"num_examples = {U64_MAX} was counted as 2000" in receipt.notice
        expected = _fedavg(base, [(100, da), (300, db), (2_000, zero)])
    assert server.wait(20) and server.coordinator.error is None
    final = server.coordinator.global_model
    assert final.round == 1
    for name, tensor in final.state.items():
        torch.testing.assert_close(tensor, expected[name])

    audit = _audit(server)
    (held,) = [r for r in audit if r["event"] in ("weight_refused", "weight_clipped")]
    assert held["event"] == f"weight_{'refused' if action == 'refuse' else 'clipped'}"
    assert (held["site"], held["round"], held["num_examples"]) == ("rogue", 1, U64_MAX)
    assert (held["limit"], held["rule"]) == (2_000, "max_weight_ratio")
    uploads = {r["site"]: r for r in audit if r["event"] == "upload"}
    assert {s: r["num_examples_counted"] for s, r in uploads.items()} == (
        {"a": 100, "b": 300} if action == "refuse" else {"a": 100, "b": 300, "rogue": 2_000}
    )
    if action == "refuse":
        (rejected,) = [r for r in audit if r["event"] == "upload_rejected"]
        assert (rejected["site"], rejected["code"]) == ("rogue", "PERMISSION_DENIED")


@pytest.mark.timeout(60)
def test_fedbuff_refuses_an_absurd_weight_before_any_other_site_uploaded(
    tmp_path, stop_after
) -> None:
    task = TinyTask()
    server = inprocess_server(
        tmp_path,
        task,
        rounds=1,
        strategy={
            "name": "fedbuff",
            "min_fit_clients": 1,
            "min_available_clients": 3,
            "options": {"buffer_size": 2},
        },
        weights={"max_num_examples": 10_000},
    )
    stop_after.append(server)
    a, b, rogue, jobs = _honest_two_and_a_rogue(server, task, stop_after)
    base = server.coordinator.global_model.state.clone()
    da, db = _delta(a, "", 1), _delta(b, "", 2)
    # First in: no other weight to compare with, so the cap decides.
    with pytest.raises(grpc.RpcError) as info:
        _send(
            rogue,
            jobs["rogue"],
            ModelState({k: torch.zeros_like(v) for k, v in da.items()}),
            U64_MAX,
        )
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "at most 10000 examples (weights.max_num_examples" in info.value.details()
    _send(a, jobs["a"], da, 100)
    _send(b, jobs["b"], db, 300)  # version 1, the last
    assert server.wait(20) and server.coordinator.error is None
    expected = _fedavg(base, [(100, da), (300, db)])  # both fresh: staleness weight 1
    for name, tensor in server.coordinator.global_model.state.items():
        torch.testing.assert_close(tensor, expected[name])
    audit = _audit(server)
    (refused,) = [r for r in audit if r["event"] == "weight_refused"]
    assert (refused["site"], refused["round"], refused["limit"]) == (
        "rogue",
        jobs["rogue"].round,
        10_000,
    )
    assert refused["rule"] == "max_num_examples" and refused["num_examples"] == U64_MAX
    assert [r["site"] for r in audit if r["event"] == "update_buffered"] == ["a", "b"]
