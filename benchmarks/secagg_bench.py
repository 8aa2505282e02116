"""SecAgg+ rounds in memory: fedtrain against Flower 1.42, and against plain aggregation.

    python benchmarks/secagg_bench.py [--repeat 3] [--flower]

For each case (n sites, m values per update) one process drives every client and the
server through all stages, every message through its byte encoding
(`run_in_memory(..., through_bytes=True)`). Everything runs on one thread (torch
too), and times are **CPU seconds** of this process (`time.process_time`): the machine
is shared, and CPU time is what a quiet machine's wall time would be, whatever the
other jobs do; the whole round's wall time is printed beside it. Reported, best of
``--repeat`` rounds:

- ``round``: CPU seconds of the whole round (wall seconds in brackets);
- ``client``: one client's compute, summed over its four stages (mean over the n
  clients), plus flattening its trained model into the update vector
  (`UpdateLayout.flatten_delta`), as a site does before masking;
- ``server``: the server's compute (routing, folding masked vectors, Shamir
  reconstruction, unmasking); the rest of ``round`` is message encoding;
- ``plain prep``: what a site does for a plain upload, `delta_chunks` (the delta
  computed and cast chunk by chunk), and ``client / plain prep``, the issue's
  client-side overhead;
- ``plain round``: fedtrain's own plain aggregation of the same updates (n plain
  preparations plus the FedAvg `WeightedSum` folding n updates), and the secure
  round's overhead over it.

The main table (and Flower's) runs with the consistency check off: the protocol under
the threat model Flower's SecAgg+ has, an honest-but-curious server. A second table
runs each case again with the check on, fedtrain's default with certificates (site
identities here from an in-memory PKI: Ed25519, as in a deployment once each
neighbour's certificate is verified and cached), and reports what the check costs:
per client, the difference in CPU seconds over all stages, and three of its parts
timed directly (verifying the neighbours' signed keys; signing the survivor set and
MACing it for each neighbour; checking the holders' attestations, MACs from
neighbours and signatures from others, before revealing), beside the masking
(stage 2); for the server, the difference in its compute (it checks every signature).

With ``--flower`` the same n, m, k and t also go through Flower 1.42's SecAgg+ client
stages and server unmasking (`benchmarks/flower_secagg.py`), in CPU seconds too: its
compute for a round is n clients plus the server (no messaging). ``Flower round`` in
the first table is the whole-round wall time measured for its SecAgg+ workflow on this
machine kind (``../shared/FLOWER_PEER.md``).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any
from unittest import mock

import numpy as np
import torch

from fedtrain.runtime.site.daemon import delta_chunks
from fedtrain.secagg import (
    ConsistencyRequest,
    KeysBroadcast,
    RoutedShares,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SetupRequest,
    UnmaskRequest,
    run_in_memory,
)
from fedtrain.secagg.updates import UpdateLayout
from fedtrain.strategy import WeightedSum
from fedtrain.tensors import DEFAULT_CHUNK_BYTES, ModelState

CASES = [
    # (n sites, m values, k neighbours or None for choose_degree)
    (100, 1_000_000, 12),
    (50, 100_000, None),
    (10, 1_000_000, None),
]
#: Flower 1.42's SecAgg+ workflow, seconds per round (../shared/FLOWER_PEER.md).
FLOWER_ROUND_S = {(100, 1_000_000): 15.6, (50, 100_000): 35.0, (10, 1_000_000): 1.5}
STAGES = {
    SetupRequest: "setup",
    KeysBroadcast: "share_keys",
    RoutedShares: "masked_input",
    ConsistencyRequest: "consistency",
    UnmaskRequest: "unmask",
}
#: Parts of the consistency check timed on their own (client methods -> bucket).
CHECK_PARTS = {
    "_check_advert": "verify_keys",
    "_consistency": "sign_survivors",
    "_check_consistency": "verify_signatures",
}


@dataclass
class Case:
    """One benchmark case's inputs: n updates of m float32 values and their weights."""

    n: int
    m: int
    k: int | None
    check: bool = False

    def __post_init__(self) -> None:
        rng = np.random.default_rng(0)
        self.updates = [
            rng.normal(0.0, 0.01, size=self.m).astype(np.float32) for _ in range(self.n)
        ]
        self.weights = [float(w) for w in rng.integers(1, 1000, size=self.n)]
        self.config = SecAggConfig(
            clip=0.1,
            max_clients=max(self.n, 100),
            max_weight=1000.0,
            k=self.k,
            consistency_check=self.check,
        )
        self.k_used, self.t_used = self.config.degree_and_threshold(self.n)


@contextmanager
def stage_clock() -> Iterator[dict[str, float]]:
    """Seconds spent in the clients' `handle`, by stage, and in the server's methods."""
    totals: dict[str, float] = defaultdict(float)

    def timed(fn: Callable[..., Any], bucket: Callable[[tuple[Any, ...]], str]) -> Any:
        @wraps(fn)
        def wrapper(self: Any, *args: Any) -> Any:
            start = time.process_time()
            try:
                return fn(self, *args)
            finally:
                totals[bucket(args)] += time.process_time() - start

        return wrapper

    patches = [
        mock.patch.object(
            SecAggClient, "handle", timed(SecAggClient.handle, lambda a: STAGES[type(a[0])])
        )
    ]
    for name, bucket in CHECK_PARTS.items():
        method = getattr(SecAggClient, name)
        patches.append(mock.patch.object(SecAggClient, name, timed(method, lambda a, b=bucket: b)))
    for name in ("start", "receive", "advance", "finish"):
        patches.append(
            mock.patch.object(
                SecAggServer, name, timed(getattr(SecAggServer, name), lambda a: "server")
            )
        )
    for patch in patches:
        patch.start()
    try:
        yield totals
    finally:
        for patch in patches:
            patch.stop()


def best_of(repeat: int, fn: Callable[[], Any]) -> float:
    """Least CPU seconds of ``repeat`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def secure_round(case: Case, repeat: int) -> tuple[float, float, dict[str, float]]:
    """(CPU s, wall s, per-stage CPU s summed over clients + server) of the best round."""
    best: tuple[float, float, dict[str, float]] = (float("inf"), 0.0, {})
    for _ in range(repeat):
        with stage_clock() as totals:
            wall, cpu = time.perf_counter(), time.process_time()
            result = run_in_memory(
                case.updates, case.weights, case.config, rng=1, through_bytes=True
            )
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert len(result.included) == case.n
        if cpu < best[0]:
            best = (cpu, wall, dict(totals))
    return best


def plain_pieces(case: Case, repeat: int) -> dict[str, float]:
    """One site's plain and secure upload preparation, and the plain server fold of n."""
    global_state = ModelState({"w": torch.zeros(case.m)})
    local = ModelState({"w": torch.from_numpy(case.updates[0])})
    layout = UpdateLayout.of(global_state.specs)
    deltas = [ModelState({"w": torch.from_numpy(u)}) for u in case.updates]

    def fold() -> None:
        total = WeightedSum(global_state.specs)
        for delta, weight in zip(deltas, case.weights, strict=True):
            total.add(delta, weight)

    return {
        "plain_prep": best_of(
            5 * repeat, lambda: list(delta_chunks(local, global_state, DEFAULT_CHUNK_BYTES))
        ),
        "flatten": best_of(5 * repeat, lambda: layout.flatten_delta(local, global_state)),
        "plain_fold": best_of(repeat, fold),
    }


def measure(case: Case, repeat: int) -> dict[str, float]:
    seconds, wall, totals = secure_round(case, repeat)
    pieces = plain_pieces(case, repeat)
    stages = {stage: totals.get(stage, 0.0) / case.n for stage in STAGES.values()}
    client = sum(stages.values()) + pieces["flatten"]
    return {
        "round": seconds,
        "round_wall": wall,
        "client": client,
        "client_mask": stages["masked_input"],
        **{part: totals.get(part, 0.0) / case.n for part in CHECK_PARTS.values()},
        "server": totals.get("server", 0.0),
        **pieces,
        "plain_round": case.n * pieces["plain_prep"] + pieces["plain_fold"],
    }


COLUMNS = (
    "case",
    "round",
    "client (stage 2)",
    "server",
    "plain prep",
    "client / plain prep",
    "plain round",
    "round / plain round",
    "Flower round (cited)",
    "speed-up",
)
FLOWER_COLUMNS = (
    "case",
    "client",
    "Flower client",
    "server",
    "Flower server",
    "round",
    "Flower n x client + server",
    "ratio",
)


CHECK_COLUMNS = (
    "case",
    "client: masking (stage 2)",
    "client: check (on - off)",
    "verify keys / sign U3 / check attestations",
    "check / masking",
    "server: check (on - off)",
    "round on / off",
)


def row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def header(columns: Sequence[str]) -> str:
    return row(columns) + "\n" + row(["---"] * len(columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flower", action="store_true", help="also time Flower 1.42's stages")
    args = parser.parse_args()
    # A site's masking is single-threaded (numpy, cryptography); torch's thread pool would
    # only add wake-up noise to the small plain-upload timings on a shared machine.
    torch.set_num_threads(1)
    print(header(COLUMNS))
    flower_rows = []
    check_rows = []
    for n, m, k in CASES:
        case = Case(n, m, k)
        f = measure(case, args.repeat)
        on = measure(Case(n, m, k, check=True), args.repeat)
        extra = on["client"] - f["client"]
        check_rows.append(
            [
                f"n={n}, m={m:,} (k={case.k_used}, t={case.t_used})",
                f"{on['client_mask'] * 1e3:.1f} ms",
                f"{extra * 1e3:.2f} ms",
                " / ".join(f"{on[p] * 1e3:.2f}" for p in CHECK_PARTS.values()) + " ms",
                f"{extra / on['client_mask']:.0%}",
                f"{(on['server'] - f['server']) * 1e3:.0f} ms",
                f"{on['round']:.2f} s / {f['round']:.2f} s",
            ]
        )
        flower = FLOWER_ROUND_S[(n, m)]
        name = f"n={n}, m={m:,} (k={case.k_used}, t={case.t_used})"
        cells = [
            name,
            f"{f['round']:.2f} s ({f['round_wall']:.2f})",
            f"{f['client'] * 1e3:.1f} ms ({f['client_mask'] * 1e3:.1f})",
            f"{f['server'] * 1e3:.0f} ms",
            f"{f['plain_prep'] * 1e3:.2f} ms",
            f"{f['client'] / f['plain_prep']:.1f}x",
            f"{f['plain_round'] * 1e3:.0f} ms",
            f"{f['round'] / f['plain_round']:.1f}x",
            f"~{flower} s",
            f"{flower / f['round']:.1f}x",
        ]
        print(row(cells), flush=True)
        if args.flower:
            from benchmarks.flower_secagg import flower_compute

            fl = flower_compute(n, case.updates, case.weights, case.k_used, case.t_used)
            flower_round = n * fl["client"] + fl["server"]
            flower_rows.append(
                [
                    name,
                    f"{f['client'] * 1e3:.1f} ms",
                    f"{fl['client'] * 1e3:.0f} ms",
                    f"{f['server'] * 1e3:.0f} ms",
                    f"{fl['server'] * 1e3:.0f} ms",
                    f"{f['round']:.2f} s",
                    f"{flower_round:.1f} s",
                    f"{flower_round / f['round']:.0f}x",
                ]
            )
    print("\nConsistency check (CPU; on - off over all stages, and its parts with it on)\n")
    print(header(CHECK_COLUMNS))
    for cells in check_rows:
        print(row(cells), flush=True)
    if flower_rows:
        print("\n" + header(FLOWER_COLUMNS))
        for cells in flower_rows:
            print(row(cells), flush=True)


if __name__ == "__main__":
    main()
