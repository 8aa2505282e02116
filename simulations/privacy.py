"""DP-FedAvg (central DP) on digits under pathological non-IID data: accuracy vs epsilon.

    python simulations/privacy.py [--rounds 30] [--keep runs/privacy]

The rounds-to-90% setup (`strategies.base_config`: 20 clients, 2 labels each, every
client trains every round, 2 local epochs), for a fixed number of rounds: FedAvg
without privacy, DP-FedAvg with clipping alone (noise multiplier 0: no privacy, shows
what clipping and equal weighting do by themselves), then DP-FedAvg at three noise
multipliers. The server clips each update to L2 norm CLIP_NORM (the median update norm
in the first rounds is ~1.3), adds Gaussian noise of std z * CLIP_NORM to the sum and
divides by the 20 clients; epsilon is the accountant's (RDP, dp-accounting) for
delta = DELTA after the last round, sampling rate 1.
"""

from __future__ import annotations

from sweep import arguments, print_header, run, table_config

CLIP_NORM = 1.0
DELTA = 1e-5
NOISE_MULTIPLIERS = (0.1, 0.3, 1.0)


def settings() -> list[tuple[str, str, dict]]:
    """(name, strategy, options) of every row."""
    rows = [("fedavg", "fedavg", {}), ("clip-only", "dpfedavg", {"noise_multiplier": 0.0})]
    rows += [(f"z={z:g}", "dpfedavg", {"noise_multiplier": z}) for z in NOISE_MULTIPLIERS]
    for _, strategy, options in rows:
        if strategy == "dpfedavg":
            options.update(clip_norm=CLIP_NORM, delta=DELTA)
    return rows


def main() -> None:
    args = arguments(__doc__)
    print_header(
        "setting",
        "noise multiplier",
        f"epsilon (delta {DELTA:g})",
        f"accuracy after {args.rounds} rounds",
        "wall time",
    )
    for name, strategy, options in settings():
        raw = table_config(args.rounds)
        raw["strategy"] = {**raw["strategy"], "name": strategy, "options": options}
        result, seconds = run(raw, name, args.keep)
        epsilon = result.history[-1].get("epsilon")
        private = f"{epsilon:.1f}" if epsilon is not None else "inf (not private)"
        print(
            f"| {name} | {options.get('noise_multiplier', '-')} | {private} "
            f"| {result.final_accuracy:.4f} | {seconds:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
