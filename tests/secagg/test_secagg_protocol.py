"""End-to-end SecAgg+ rounds: exact sums under dropouts, and every refusal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedtrain.errors import SecAggError
from fedtrain.secagg import (
    InMemoryPKI,
    KeysBroadcast,
    MaskedInput,
    RoutedShares,
    SecAggClient,
    SecAggConfig,
    SecAggResult,
    SecAggServer,
    SetupRequest,
    Stage,
    UnmaskRequest,
    neighbour_graph,
    run_in_memory,
)

M = 1000
GRAPH_SEED = bytes(range(32))
# k per n, so that 30% dropouts anywhere leave every site >= t share holders.
K_FOR_N = {3: 2, 10: 6, 50: 32}


def _inputs(n: int, seed: int) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    rng = np.random.default_rng(seed)
    sites = sorted(rng.choice(np.arange(1, 10_000), size=n, replace=False).tolist())
    xs = {s: rng.normal(0.0, 0.4, size=M).astype(np.float32) for s in sites}
    ws = {s: float(rng.integers(1, 500)) for s in sites}
    return xs, ws


def _expected(
    config: SecAggConfig,
    xs: dict[int, np.ndarray],
    ws: dict[int, float],
    rng_seed: int,
    included: tuple[int, ...],
) -> np.ndarray:
    """Sum of the included sites' encodings, replaying run_in_memory's per-site rngs."""
    q = config.quantizer()
    rngs = np.random.default_rng(rng_seed).spawn(len(xs))
    total = np.zeros(M + 1, dtype=np.uint64)
    for (site, x), rng in zip(sorted(xs.items()), rngs, strict=True):
        enc = q.encode(x, ws[site], rng)
        if site in included:
            total += enc
    assert total.max() < 2**32  # the budget guarantees no wrap
    return total.astype(np.uint32)


def _check_result(
    result: SecAggResult,
    config: SecAggConfig,
    xs: dict[int, np.ndarray],
    ws: dict[int, float],
    rng_seed: int,
    dropped: set[int],
) -> None:
    assert set(result.included) == set(xs) - dropped
    assert set(result.dropped) == dropped
    assert np.array_equal(result.total, _expected(config, xs, ws, rng_seed, result.included))
    inc = result.included
    weight = sum(ws[s] for s in inc)
    float_mean = sum(np.clip(xs[s], -1, 1).astype(np.float64) * ws[s] for s in inc) / weight
    bound = config.quantizer().mean_error_bound(len(inc), weight)
    assert result.total_weight == weight
    assert np.all(np.abs(result.weighted_mean() - float_mean) < bound)


CASES = [(n, None, 0, True) for n in K_FOR_N] + [
    (n, stage, count, check)  # without the consistency check: the n=10 rounds once more
    for n in K_FOR_N
    for stage in range(5)
    for count in ("one", "30%")
    for check in ((True, False) if n == 10 else (True,))
]


@pytest.mark.parametrize(("n", "stage", "count", "check"), CASES)
def test_exact_sum_under_dropouts(n: int, stage: int | None, count: object, check: bool) -> None:
    xs, ws = _inputs(n, seed=n)
    config = SecAggConfig(
        clip=1.0, max_clients=64, max_weight=500.0, k=K_FOR_N[n], consistency_check=check
    )
    k_drop = {0: 0, "one": 1, "30%": round(0.3 * n)}[count]  # type: ignore[index]
    rng = np.random.default_rng(1000 + n + 10 * (stage or 0))
    dropped = set(rng.choice(sorted(xs), size=k_drop, replace=False).tolist())
    dropouts = {stage: dropped} if stage is not None else None
    result = run_in_memory(
        xs,
        ws,
        config,
        dropouts,
        round_id=9,
        rng=7,
        graph_seed=GRAPH_SEED,
        through_bytes=(n == 10),
    )
    # A site that vanishes after sending its masked input (stages 3, 4) is still included.
    _check_result(result, config, xs, ws, 7, dropped if stage is None or stage < 3 else set())


def test_auto_degree_and_chunked_streaming_with_a_broken_upload() -> None:
    xs, ws = _inputs(40, seed=3)
    config = SecAggConfig(clip=1.0, max_clients=64, max_weight=500.0, dropout_rate=0.05)
    broken = sorted(xs)[5]
    result = run_in_memory(
        xs,
        ws,
        config,
        {1: [sorted(xs)[0]]},
        rng=11,
        chunk_elements=128,
        broken_uploads=[broken],
    )
    _check_result(result, config, xs, ws, 11, {sorted(xs)[0], broken})


def test_too_many_dropouts_raise_a_clear_error() -> None:
    xs, ws = _inputs(20, seed=4)
    config = SecAggConfig(max_clients=64, max_weight=500.0, k=4)  # 5 holders, t = 3
    sites = sorted(xs)
    nbrs = sorted(neighbour_graph(sites, 4, GRAPH_SEED)[sites[0]])
    # Three of site 0's four neighbours vanish before signing the survivor set, or before
    # unmasking: its seed is lost.
    for stage in (3, 4):
        with pytest.raises(SecAggError, match=rf"fewer than t=3 .*site {sites[0]}\b"):
            run_in_memory(xs, ws, config, {stage: nbrs[:3]}, rng=1, graph_seed=GRAPH_SEED)
    # ... or before sending masked inputs, with site 0 too: its mask key is lost.
    with pytest.raises(SecAggError, match="too many dropouts"):
        run_in_memory(xs, ws, config, {2: [sites[0], *nbrs[:3]]}, rng=1, graph_seed=GRAPH_SEED)
    # Almost everyone gone at setup.
    with pytest.raises(SecAggError, match="advertised keys"):
        run_in_memory(xs, ws, config, {0: sites[2:]}, rng=1, graph_seed=GRAPH_SEED)


# -- manual driving, for the refusals ---------------------------------------------------


def _round(n: int = 6, k: int = 4, t: int | None = None) -> tuple[SecAggServer, dict]:
    config = SecAggConfig(max_clients=16, max_weight=100.0, k=k, t=t)
    sites = list(range(1, n + 1))
    pki = InMemoryPKI()
    server = SecAggServer.from_config(config, 5, sites, 50, GRAPH_SEED, verifier=pki)
    clients = {
        s: SecAggClient(
            s, rng=np.random.default_rng(s), identity=pki.enrol(f"site-{s}"), verifier=pki
        )
        for s in sites
    }
    for s, c in clients.items():
        c.set_input(np.full(50, 0.1 * s), 10.0)
    return server, clients


def _step(server: SecAggServer, clients: dict, outgoing: dict) -> dict:
    for s, msg in outgoing.items():
        server.receive(clients[s].handle(msg))
    return server.advance()


def _to_unmask(n: int = 6, k: int = 4) -> tuple[SecAggServer, dict, dict]:
    server, clients = _round(n, k)
    out = server.start()
    for _ in range(4):
        out = _step(server, clients, out)
    assert server.stage == Stage.UNMASK
    return server, clients, out


def test_client_refuses_a_threshold_at_or_below_half_the_holders() -> None:
    server, _ = _round(n=10, k=4)
    setup = server.start()[1]
    assert (setup.params.k, setup.params.t) == (4, 3)  # 5 holders: t = 3 > 2.5
    # t <= (k + 1) / 2; k = 5 rounds up to degree 6, so t = 3 <= 3.5 is refused too.
    for k, bad_t in ((4, 1), (4, 2), (5, 3), (8, 4)):
        bad = dataclasses.replace(setup.params, k=k, t=bad_t)
        client = SecAggClient(1)
        with pytest.raises(SecAggError, match="insecure"):
            client.handle(SetupRequest(1, bad))
        assert client.stage == Stage.FAILED
    with pytest.raises(SecAggError, match="exceeds"):
        SecAggClient(1).handle(SetupRequest(1, dataclasses.replace(setup.params, t=6)))
    with pytest.raises(SecAggError, match="wrap"):
        SecAggClient(1).handle(SetupRequest(1, dataclasses.replace(setup.params, bits=30)))


def test_client_refuses_to_reveal_both_secrets_of_a_site() -> None:
    _, clients, requests = _to_unmask()
    req = requests[1]
    other = next(s for s in req.survivors if s != 1)
    both = UnmaskRequest(req.round_id, 1, req.survivors, (*req.dropped, other))
    with pytest.raises(SecAggError, match=f"both secrets of sites \\[{other}\\]"):
        clients[1].handle(both)
    # A second request after an honest one is refused too (no second chance to ask
    # for the other secret).
    req2 = requests[2]
    clients[2].handle(req2)
    flipped = UnmaskRequest(req2.round_id, 2, (2,), tuple(s for s in req2.survivors if s != 2))
    with pytest.raises(SecAggError, match="round is over"):
        clients[2].handle(flipped)


def test_client_refuses_unmask_requests_that_make_no_sense() -> None:
    _, clients, requests = _to_unmask()
    req = requests[3]
    with pytest.raises(SecAggError, match="do not hold"):
        clients[3].handle(UnmaskRequest(req.round_id, 3, (*req.survivors, 99), ()))
    req = requests[4]
    with pytest.raises(SecAggError, match="fewer than t"):
        clients[4].handle(UnmaskRequest(req.round_id, 4, (4,), ()))


def test_tampered_share_is_detected() -> None:
    server, clients = _round()
    out = server.start()
    out = _step(server, clients, out)
    out = _step(server, clients, out)
    routed: RoutedShares = out[1]
    sender, ct = routed.ciphertexts[0]
    bad = bytearray(ct)
    bad[len(bad) // 2] ^= 0x04
    tampered = RoutedShares(routed.round_id, 1, ((sender, bytes(bad)), *routed.ciphertexts[1:]))
    with pytest.raises(SecAggError, match=f"shares from site {sender} to site 1 failed"):
        clients[1].handle(tampered)
    # A genuine ciphertext replayed to another receiver fails authentication too.
    routed3: RoutedShares = out[3]
    u = routed3.ciphertexts[-1][0]
    ct_for_other = next(
        dict(m.ciphertexts)[u] for r, m in out.items() if r != 3 and u in dict(m.ciphertexts)
    )
    replay = RoutedShares(routed3.round_id, 3, (*routed3.ciphertexts[:-1], (u, ct_for_other)))
    with pytest.raises(SecAggError, match="failed authentication"):
        clients[3].handle(replay)


def test_client_checks_its_neighbours_keys() -> None:
    server, clients = _round(n=10, k=4)
    out = server.start()
    for s, msg in out.items():
        server.receive(clients[s].handle(msg))
    out = server.advance()
    keys: KeysBroadcast = out[1]
    forged = KeysBroadcast(keys.round_id, 1, keys.sites, keys.keys[:-1])
    with pytest.raises(SecAggError, match="my neighbours"):
        clients[1].handle(forged)
    k2: KeysBroadcast = out[2]
    dup = dataclasses.replace(k2.keys[1], enc_key=k2.keys[0].enc_key)
    with pytest.raises(SecAggError, match="not all distinct"):
        clients[2].handle(KeysBroadcast(k2.round_id, 2, k2.sites, (k2.keys[0], dup, *k2.keys[2:])))


def test_server_rejects_bad_messages_without_losing_state() -> None:
    server, clients = _round()
    out = server.start()
    replies = {s: clients[s].handle(m) for s, m in out.items()}
    assert server.pending == frozenset(range(1, 7))
    server.receive(replies[1])
    assert server.pending == frozenset(range(2, 7))
    with pytest.raises(SecAggError, match="twice"):
        server.receive(replies[1])
    with pytest.raises(SecAggError, match="round 6"):
        server.receive(dataclasses.replace(replies[2], round_id=6))
    for s in range(2, 7):
        server.receive(replies[s])
    out = server.advance()
    with pytest.raises(SecAggError, match="stage SHARE_KEYS"):
        server.receive(replies[3])  # late stage-0 reply
    out = _step(server, clients, out)
    masked = {s: clients[s].handle(m) for s, m in out.items()}
    short = MaskedInput(5, 1, masked[1].vector[:10].copy())
    with pytest.raises(SecAggError, match="shorter"):
        server.receive(short)
    with pytest.raises(SecAggError, match="outside"):
        server.receive(MaskedInput(5, 1, np.zeros(52, dtype=np.uint32)))
    for msg in masked.values():
        server.receive(msg)
    out = server.advance()
    assert server.stage == Stage.CONSISTENCY
    out = _step(server, clients, out)
    for s, msg in out.items():
        server.receive(clients[s].handle(msg))
    result = server.finish()
    assert result.included == tuple(range(1, 7))
    expected = sum(0.1 * s * 10 for s in range(1, 7)) / 60
    assert np.allclose(result.weighted_mean(), expected, atol=1e-4)


def test_masked_vector_alone_is_uniform() -> None:
    # A constant update (zeros) encodes to one value repeated; masked, it must look
    # like uniform bytes and bits. Chi-square with a loose threshold and fixed seeds.
    n, m = 4, 20_000
    config = SecAggConfig(max_clients=8, max_weight=10.0, k=2, consistency_check=False)
    server = SecAggServer.from_config(config, 1, range(1, n + 1), m, GRAPH_SEED)
    clients = {s: SecAggClient(s, rng=np.random.default_rng(s)) for s in range(1, n + 1)}
    for c in clients.values():
        c.set_input(np.zeros(m), 1.0)
    out = server.start()
    out = _step(server, clients, out)
    out = _step(server, clients, out)
    vector = clients[1].handle(out[1]).vector
    raw = config.quantizer().encode(np.zeros(m), 1.0, np.random.default_rng(0))

    def chi2_bytes(v: np.ndarray) -> float:
        counts = np.bincount(v.view(np.uint8), minlength=256)
        expected = v.nbytes / 256
        return float(((counts - expected) ** 2 / expected).sum())

    # df = 255: mean 255, sd ~22.6; 400 is > 6 sd out.
    assert chi2_bytes(vector) < 400
    assert chi2_bytes(raw) > 10_000  # the test has power: unmasked data fails it
    bits = np.unpackbits(vector.view(np.uint8)).reshape(-1, 32).mean(axis=0)
    assert np.all(np.abs(bits - 0.5) < 6 * 0.5 / np.sqrt(m))
