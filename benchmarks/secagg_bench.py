"""Time whole SecAgg+ rounds in memory (all sites and the server in one process).

    python benchmarks/secagg_bench.py [--repeat 3]

Prints seconds per round (best of --repeat), messages through their byte encoding.
Flower 1.42's SecAgg+ measured the same way (FLOWER_PEER.md): n=10, m=1M ~1.5 s;
n=50, m=100k ~35 s; n=100, m=1M, k=12 ~15.6 s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedtrain.secagg import SecAggConfig, run_in_memory

CASES = [
    # (n sites, m values, k neighbours or None for choose_degree)
    (10, 1_000_000, None),
    (50, 100_000, None),
    (100, 1_000_000, 12),
]


def bench(n: int, m: int, k: int | None, repeat: int) -> tuple[float, int, int]:
    rng = np.random.default_rng(0)
    xs = [rng.normal(0.0, 0.01, size=m).astype(np.float32) for _ in range(n)]
    ws = [float(w) for w in rng.integers(1, 1000, size=n)]
    config = SecAggConfig(clip=0.1, max_clients=max(n, 100), max_weight=1000.0, k=k)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = run_in_memory(xs, ws, config, rng=1, through_bytes=True)
        best = min(best, time.perf_counter() - start)
        assert len(result.included) == n
    k_used, t_used = config.degree_and_threshold(n)
    return best, k_used, t_used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for n, m, k in CASES:
        seconds, k_used, t_used = bench(n, m, k, args.repeat)
        print(f"n={n:<4d} m={m:<9,d} k={k_used:<3d} t={t_used:<3d} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
