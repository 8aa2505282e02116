"""Download codecs on a real deployment: bytes per round and round time, fp32 vs fp16 vs delta.

Each row is one run of `benchmarks.fedtrain_deploy` (a real `fedtrain server` and
`fedtrain client` processes on loopback, `--insecure`) with the FlatTask model of
`--params` float32 values, under one `[download]` table and one `[compression]`
table. The server's own counters (`metrics.jsonl`: `bytes_out` is every byte of
model downloads, `bytes_in` every byte of uploads) give the bytes per site per round;
rounds after the first are shown (the first download is the whole model for every
encoding: no site holds a version yet). The link column projects what the same bytes
take on a `--mbit` link per site (transfer only: training and the server's work are
what loopback's seconds per round show), and the last column that as a share of the
uncompressed round's transfer, the issue 15 target (a 10 Mbit/s site with top-k 1%
uploads and compressed downloads: <= 30%).

CLI::

    python -m benchmarks.download_codecs --params 10000000 --sites 2 --rounds 4 --mbit 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.fedtrain_deploy import run_fedtrain_deployment

TOPK_UPLOADS = {"codec": "topk", "fraction": 0.01}
#: (row label, [download] table, [compression] table)
ROWS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("fp32 down, fp32 up", {}, {}),
    ("fp32 down, top-k 1% up", {}, TOPK_UPLOADS),
    ("fp16 down, top-k 1% up", {"codec": "fp16"}, TOPK_UPLOADS),
    ("delta int8 down, top-k 1% up", {"codec": "int8", "delta": True}, TOPK_UPLOADS),
    (
        "delta top-k 1% down, top-k 1% up",
        {"codec": "topk", "delta": True, "fraction": 0.01},
        TOPK_UPLOADS,
    ),
)


def measure(
    params: int, sites: int, rounds: int, workdir: Path, timeout_s: float
) -> list[dict[str, Any]]:
    """One deployment per row; bytes per site per round after the first, s per round."""
    out = []
    for label, download, compression in ROWS:
        options: dict[str, Any] = {}
        if download:
            options["download"] = download
        if compression:
            options["compression"] = compression
        run = run_fedtrain_deployment(
            params, sites, rounds, workdir / label.replace(" ", "_"), timeout_s,
            server_options=options,
        )  # fmt: skip
        if not run["ok"]:
            raise RuntimeError(f"{label}: {run['error']}")
        metrics = [
            json.loads(line)
            for line in (Path(run["workdir"]) / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        later = metrics[1:]
        out.append(
            {
                "row": label,
                "first_down": metrics[0]["bytes_out"] / sites,
                "down": statistics.median(m["bytes_out"] for m in later) / sites,
                "up": statistics.median(m["bytes_in"] for m in later) / sites,
                "s_per_round": statistics.median(run["s_per_round"][1:]),
            }
        )
    return out


def table(rows: list[dict[str, Any]], mbit: float) -> str:
    """The RESULTS.md table."""
    link = [(r["down"] + r["up"]) * 8 / (mbit * 1e6) for r in rows]
    lines = [
        f"| encoding | down MB/site (round 1) | down MB/site | up MB/site | loopback s/round "
        f"| {mbit:g} Mbit/s transfer s | share of fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, seconds in zip(rows, link, strict=True):
        lines.append(
            f"| {r['row']} | {r['first_down'] / 1e6:.1f} | {r['down'] / 1e6:.2f} "
            f"| {r['up'] / 1e6:.2f} | {r['s_per_round']:.2f} | {seconds:.1f} "
            f"| {seconds / link[0]:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedtrain-download-codecs-") as tmp:
        rows = measure(args.params, args.sites, args.rounds, Path(tmp), args.timeout)
    print(table(rows, args.mbit))


if __name__ == "__main__":
    main()
