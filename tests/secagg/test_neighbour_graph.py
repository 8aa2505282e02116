"""The SecAgg+ neighbour graph and the threshold rules."""

from __future__ import annotations

import os

import pytest

from fedtrain.errors import SecAggError
from fedtrain.secagg import check_threshold, choose_degree, neighbour_graph, neighbours_of
from fedtrain.secagg.graph import effective_degree, min_threshold


@pytest.mark.parametrize(("n", "k"), [(100, 12), (51, 8), (20, 7), (10, 9), (10, 30), (3, 2)])
def test_graph_is_regular_symmetric_and_deterministic(n: int, k: int) -> None:
    seed = os.urandom(32)
    sites = [3 * i + 5 for i in range(n)]
    graph = neighbour_graph(reversed(sites), k, seed)
    d = effective_degree(k, n)
    assert d == min(k + k % 2, n - 1)
    assert set(graph) == set(sites)
    for s, nbrs in graph.items():
        assert s not in nbrs
        assert len(nbrs) == d
        assert all(s in graph[v] for v in nbrs)
        assert neighbours_of(s, sites, k, seed) == nbrs
    assert neighbour_graph(sites, k, seed) == graph


def test_graph_depends_on_the_public_seed() -> None:
    sites = list(range(1, 41))
    assert neighbour_graph(sites, 4, b"a" * 32) != neighbour_graph(sites, 4, b"b" * 32)
    with pytest.raises(SecAggError, match="32 bytes"):
        neighbour_graph(sites, 4, b"short")
    with pytest.raises(SecAggError, match="not among"):
        neighbours_of(99, sites, 4, b"a" * 32)


def test_threshold_must_exceed_half_the_holders() -> None:
    check_threshold(7, 12, 100)  # 13 holders, 7 > 6.5
    with pytest.raises(SecAggError, match="insecure"):
        check_threshold(6, 12, 100)
    with pytest.raises(SecAggError, match="insecure"):
        check_threshold(6, 11, 100)  # k rounds up to 12
    with pytest.raises(SecAggError, match="exceeds"):
        check_threshold(14, 12, 100)
    assert min_threshold(12) == 7
    assert min_threshold(9) == 6


def test_choose_degree_grows_logarithmically_and_is_valid() -> None:
    previous = 0
    for n in (100, 1000, 10_000, 100_000):
        k, t = choose_degree(n, dropout_rate=0.1, corruption_rate=0.05)
        check_threshold(t, k, n)
        assert k < n - 1 and k % 2 == 0
        assert k >= previous
        previous = k
    assert previous < 60
    assert choose_degree(10, 0.1) == (9, 6)  # too few sites: the complete graph
    with pytest.raises(SecAggError):
        choose_degree(10, 1.5)
