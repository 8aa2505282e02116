"""The sparse neighbour graph of SecAgg+ (Bell et al. 2020).

Each site exchanges masks and secret shares only with its ``k`` graph neighbours, so
per-site work is O(k + m) instead of O(n + m). The graph is a Harary graph
(a circulant: each site is joined to the ``k/2`` sites on either side of it on a ring)
laid over the sites in a *pseudo-random order* derived from a public 32-byte seed:
``sorted(sites, key=SHA-256(seed || site))``. Server and sites compute it on their own
from the same public inputs, so nobody has to trust a neighbour list sent to them,
and the order is stable across Python/numpy versions.

``k`` is rounded up to an even number (so the circulant is exactly regular) and capped
at ``n - 1`` (the complete graph, i.e. classic SecAgg).

Each site Shamir-shares its two secrets among its ``k`` neighbours *and itself*
(``k + 1`` holders) with threshold ``t``. Correctness needs at least ``t`` of the
``k + 1`` holders to survive to the unmasking stage. Security needs
``t > (k + 1) / 2``, but that alone is not enough: every honest holder reveals at most
one of a site's two shares, yet a server that *lies* about who dropped can tell some
holders that the site survived (they reveal seed shares) and others that it dropped
(they reveal mask-key shares). What makes ``t > (k + 1) / 2`` sufficient is the
consistency check (`fedtrain.secagg.consistency`): a holder reveals only when ``t`` of
the site's holders signed the survivor set it was told, and two disjoint groups of
``t`` among ``k + 1`` do not exist. Against an honest-but-curious server (one story
for everyone) the bound suffices on its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Iterable, Mapping, Sequence

from fedtrain.errors import SecAggError

logger = logging.getLogger(__name__)

GRAPH_SEED_BYTES = 32


def effective_degree(k: int, n: int) -> int:
    """Degree the graph really has for ``n`` sites: ``k`` rounded up to even, <= n - 1."""
    if k < 1:
        raise SecAggError(f"neighbour count k must be >= 1, got {k}")
    if n < 1:
        raise SecAggError(f"number of sites must be >= 1, got {n}")
    return min(k + (k % 2), n - 1)


def min_threshold(degree: int) -> int:
    """Smallest secure threshold for ``degree + 1`` share holders: ``> (degree + 1) / 2``."""
    return (degree + 1) // 2 + 1


def check_threshold(t: int, k: int, n: int) -> None:
    """Refuse a threshold that is insecure (``t <= (d+1)/2``) or unreachable (``t > d+1``).

    ``d`` is the effective degree for ``n`` sites. Both the server and every site call
    this: a site must not trust the server's parameters.
    """
    d = effective_degree(k, n)
    if 2 * t <= d + 1:
        raise SecAggError(
            f"threshold t={t} is insecure for {d + 1} share holders (k={k} -> degree {d}, "
            f"{n} sites): it must exceed (k + 1) / 2 = {(d + 1) / 2}, i.e. t >= "
            f"{min_threshold(d)}, or the server could collect both secrets of a site"
        )
    if t > d + 1:
        raise SecAggError(
            f"threshold t={t} exceeds the {d + 1} share holders each site has (k={k} -> "
            f"degree {d}, {n} sites): no secret could ever be reconstructed"
        )


def _order(sites: Iterable[int], seed: bytes) -> list[int]:
    if len(seed) != GRAPH_SEED_BYTES:
        raise SecAggError(f"graph seed must be {GRAPH_SEED_BYTES} bytes, got {len(seed)}")
    ids = sorted(set(sites))
    return sorted(ids, key=lambda s: hashlib.sha256(seed + s.to_bytes(8, "little")).digest())


def neighbour_graph(sites: Iterable[int], k: int, seed: bytes) -> dict[int, frozenset[int]]:
    """``{site: its neighbours}`` for all sites (the site itself is never included)."""
    return dict(_graph(tuple(sorted(set(sites))), k, seed))


@functools.lru_cache(maxsize=8)
def _graph(ids: tuple[int, ...], k: int, seed: bytes) -> dict[int, frozenset[int]]:
    # Cached: in the simulation every client of a round builds the same graph.
    order = _order(ids, seed)
    n = len(order)
    if n == 0:
        return {}
    d = effective_degree(k, n)
    graph: dict[int, frozenset[int]] = {}
    if d == n - 1:
        everyone = frozenset(order)
        return {s: everyone - {s} for s in order}
    half = d // 2
    for i, s in enumerate(order):
        graph[s] = frozenset(order[(i + j) % n] for j in range(-half, half + 1) if j != 0)
    return graph


def components(members: Iterable[int], graph: Mapping[int, frozenset[int]]) -> list[list[int]]:
    """The connected components of the subgraph that ``members`` induce, each sorted.

    Pairwise masks run along graph edges, so the masked inputs of a component whose
    other neighbours all dropped (their mask keys revealed) sum to that component's
    plain sum: a survivor set of two or more components would be unmasked piecewise.
    """
    left = set(members)
    out = []
    while left:
        start = min(left)
        left.discard(start)
        part, todo = [start], [start]
        while todo:
            for v in graph.get(todo.pop(), frozenset()) & left:
                left.discard(v)
                part.append(v)
                todo.append(v)
        out.append(sorted(part))
    return out


def neighbours_of(site: int, sites: Sequence[int], k: int, seed: bytes) -> frozenset[int]:
    """Neighbours of one ``site`` (what a site computes for itself)."""
    order = _order(sites, seed)
    if site not in order:
        raise SecAggError(f"site {site} is not among the {len(order)} sites of the graph")
    n = len(order)
    d = effective_degree(k, n)
    if d == n - 1:
        return frozenset(order) - {site}
    i = order.index(site)
    half = d // 2
    return frozenset(order[(i + j) % n] for j in range(-half, half + 1) if j != 0)


def _log_binom_tail_ge(h: int, p: float, t: int) -> float:
    """log P[Binomial(h, p) >= t] (log-space, so h may be large)."""
    if t <= 0:
        return 0.0
    if t > h:
        return -math.inf
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(h + 1) - math.lgamma(i + 1) - math.lgamma(h - i + 1) + i * lp + (h - i) * lq
        for i in range(t, h + 1)
    ]
    top = max(terms)
    return top + math.log(sum(math.exp(x - top) for x in terms))


@functools.lru_cache(maxsize=256)
def choose_degree(
    n: int,
    dropout_rate: float,
    corruption_rate: float = 0.0,
    failure_probability: float = 1e-6,
    leak_probability: float = 1e-9,
) -> tuple[int, int]:
    """Pick ``(k, t)`` for ``n`` sites: the smallest even degree meeting both targets.

    Model: each site drops out independently with probability ``dropout_rate`` and is
    corrupt (colluding with the server) independently with ``corruption_rate``. For a
    site with ``h = k + 1`` share holders, with a union bound over the ``n`` sites:

    * correctness: ``P[Binomial(h, 1 - dropout_rate) < t] <= failure_probability / n``
      (enough holders survive to reconstruct every needed secret);
    * privacy: ``P[Binomial(h, corruption_rate) >= t] <= leak_probability / n``
      (corrupt holders alone cannot reconstruct a secret).

    Both tails fall exponentially in ``h``, so ``k = O(log n)``. Among feasible ``t`` the
    largest is returned (most privacy margin), never below ``(k + 1) / 2``. When no degree
    below ``n - 1`` meets the targets, the complete graph (classic SecAgg) is returned
    with the smallest secure ``t`` (logged at INFO if it misses the targets).
    Pure, so cached: a driver asking every round logs that once per round size.
    The model assumes corruption and dropout do not depend on the (public) graph order.
    """
    if n < 2:
        raise SecAggError(f"secure aggregation needs at least 2 sites, got {n}")
    for name, v in (("dropout_rate", dropout_rate), ("corruption_rate", corruption_rate)):
        if not (0.0 <= v < 1.0):
            raise SecAggError(f"{name} must be in [0, 1), got {v}")
    targets = (("failure_probability", failure_probability), ("leak_probability", leak_probability))
    for name, v in targets:
        if not (0.0 < v < 1.0):
            raise SecAggError(f"{name} must be in (0, 1), got {v}")
    log_fail = math.log(failure_probability / n)
    log_leak = math.log(leak_probability / n)
    for d in range(2, n - 1, 2):
        h = d + 1
        best = None
        for t in range(min_threshold(d), h + 1):
            # P[survivors < t] = P[dropped >= h - t + 1]
            ok_fail = _log_binom_tail_ge(h, dropout_rate, h - t + 1) <= log_fail
            ok_leak = _log_binom_tail_ge(h, corruption_rate, t) <= log_leak
            if ok_fail and ok_leak:
                best = t
        if best is not None:
            return d, best
    d = n - 1
    t = min_threshold(d)
    h = d + 1
    if (
        _log_binom_tail_ge(h, dropout_rate, h - t + 1) > log_fail
        or _log_binom_tail_ge(h, corruption_rate, t) > log_leak
    ):
        logger.info(
            "secagg: %d sites are too few to meet failure_probability=%g and "
            "leak_probability=%g at dropout_rate=%g, corruption_rate=%g; using the complete "
            "graph (k=%d, t=%d)",
            n,
            failure_probability,
            leak_probability,
            dropout_rate,
            corruption_rate,
            d,
            t,
        )
    return d, t
