"""DP-FedAvg (central DP) on digits under pathological non-IID data: accuracy vs epsilon.

    python simulations/privacy.py [--rounds 30] [--repeats 3] [--noise 0.1 0.3 1 3]
                                  [--keep runs/privacy] [--only fedavg z=1]

The rounds-to-90% setup (`strategies.base_config`: 20 clients, 2 labels each, every
client trains every round, 2 local epochs), for a fixed number of rounds: FedAvg
without privacy, DP-FedAvg with clipping alone (noise multiplier 0: no privacy, shows
what clipping and equal weighting do by themselves), then DP-FedAvg at four noise
multipliers. The server clips each update to L2 norm CLIP_NORM (the median update norm
in the first rounds is ~1.3), adds Gaussian noise of std z * CLIP_NORM to the sum and
divides by the 20 clients; epsilon is the accountant's (RDP, dp-accounting) for
delta = DELTA after the last round, sampling rate 1. The noise comes from the OS
CSPRNG, not the seed, so each noisy row is run --repeats times (mean +- std).
"""

from __future__ import annotations

import argparse
import statistics

from sweep import TAIL, arguments, print_header, run, table_config, tail_accuracy

CLIP_NORM = 1.0
DELTA = 1e-5
NOISE_MULTIPLIERS = (0.1, 0.3, 1.0, 3.0)


def settings(noise_multipliers: list[float]) -> list[tuple[str, str, dict]]:
    """(name, strategy, options) of every row."""
    rows = [("fedavg", "fedavg", {}), ("clip-only", "dpfedavg", {"noise_multiplier": 0.0})]
    rows += [(f"z={z:g}", "dpfedavg", {"noise_multiplier": z}) for z in noise_multipliers]
    for _, strategy, options in rows:
        if strategy == "dpfedavg":
            options.update(clip_norm=CLIP_NORM, delta=DELTA)
    return rows


def spread(values: list[float]) -> str:
    """Mean, and +- the standard deviation when there are several values."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, nargs="+", default=list(NOISE_MULTIPLIERS))
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each noisy row (the noise is unseeded)"
    )
    args = arguments(__doc__, parser)
    print_header(
        "setting",
        "noise multiplier",
        f"epsilon (delta {DELTA:g})",
        f"accuracy after {args.rounds} rounds",
        f"mean accuracy, last {TAIL} rounds",
        "wall time per run",
    )
    for name, strategy, options in settings(args.noise):
        if args.only and name not in args.only:
            continue
        raw = table_config(args.rounds)
        raw["strategy"] = {**raw["strategy"], "name": strategy, "options": options}
        repeats = args.repeats if options.get("noise_multiplier") else 1
        runs = [run(raw, f"{name}-{i}", args.keep) for i in range(repeats)]
        epsilon = runs[0][0].history[-1].get("epsilon")
        private = f"{epsilon:.1f}" if epsilon is not None else "inf (not private)"
        print(
            f"| {name} | {options.get('noise_multiplier', '-')} | {private} "
            f"| {spread([r.final_accuracy for r, _ in runs])} "
            f"| {spread([tail_accuracy(r) for r, _ in runs])} "
            f"| {statistics.mean(s for _, s in runs):.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
