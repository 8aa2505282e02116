"""Update codecs on digits under pathological non-IID data: upload bytes vs accuracy.

    python simulations/compression.py [--rounds 30] [--keep runs/compression] [--only topk-0.1]

The rounds-to-90% setup (`strategies.base_config`: FedAvg, 20 clients, 2 labels each,
every client trains every round, 2 local epochs) for a fixed number of rounds, once
per codec. Each client encodes its update with the codec, the server decodes it
before folding; `bytes_up` in metrics.jsonl is what the encoded uploads take on the
wire. Top-k keeps its error-feedback residual per client across rounds.
"""

from __future__ import annotations

from sweep import TAIL, arguments, print_header, run, table_config, tail_accuracy

CODECS: list[tuple[str, dict]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("topk", {"fraction": 0.1}),
    ("topk", {"fraction": 0.01}),
]


def main() -> None:
    args = arguments(__doc__)
    print_header(
        "codec",
        "upload per client",
        "vs float32",
        "uploads per round",
        f"accuracy after {args.rounds} rounds",
        f"mean accuracy, last {TAIL} rounds",
        "wall time",
    )
    dense = None
    for codec, options in CODECS:
        raw = table_config(args.rounds)
        raw["compression"] = {"codec": codec, **options}
        name = codec + "".join(f"-{v:g}" for v in options.values())
        if args.only and name not in args.only:
            continue
        result, seconds = run(raw, name, args.keep)
        last = result.history[-1]
        per_client = last["bytes_up"] / (last["clients"] + len(last["failed"]))  # arrived
        dense = dense or per_client
        label = f"{codec} {', '.join(f'{k} {v:g}' for k, v in options.items())}".strip()
        print(
            f"| {label} | {per_client / 1024:.1f} KiB | {per_client / dense:.3f} "
            f"| {last['bytes_up'] / 2**20:.2f} MiB | {result.final_accuracy:.4f} "
            f"| {tail_accuracy(result):.4f} | {seconds:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
