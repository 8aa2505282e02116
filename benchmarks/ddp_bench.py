"""Intra-site DDP: step time of 1 vs 2 processes, and a site's round through WorkerGroup.

    python benchmarks/ddp_bench.py [--steps 20] [--batch 32] [--repeat 3] [--gpu]

CPU (always): a compute-bound CNN (3 conv layers on 32x32 inputs, 97k parameters, so
a 0.4 MB all-reduce against ~5.5 GFLOP per forward+backward step of 32 examples).
Every process runs with torch.set_num_threads(1), so one process uses one core and
two processes two: the comparison is per-core scaling, not threads against processes.

- step: the same per-process batch in 1 process (plain module) and in 2 processes
  (DDP, gloo); ratio = t(2) / t(1) (1.0 is perfect scaling: twice the examples in the
  same time), throughput speed-up = 2 * t(1) / t(2).
- round: one `WorkerGroup.train_round` over the same site data (1 epoch, same
  per-rank batch) with nproc=1 and nproc=2: what a site gains end to end,
  including moving the model in and out and the broadcast.

The 1- and 2-process runs alternate `--repeat` times and each figure is the median,
so a change in background load hits both sides alike; the load average is printed.

GPU (`--gpu`, only where CUDA exists): the same step on one GPU as a plain module
and wrapped in DDP (world of 1, NCCL): the wrapper's own cost; with 2+ GPUs also the
2-GPU DDP step.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedtrain.task import TorchTask, model_for
from fedtrain.tensors import ModelState

WARMUP = 3


def cnn() -> nn.Module:
    """Convolutions dominate: many FLOPs per parameter, so compute, not the all-reduce."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip


class BenchTask(TorchTask):
    """The CNN on random 32x32 images, for the WorkerGroup round."""

    def __init__(self, n: int = 512) -> None:
        self.n = n

    def model(self) -> nn.Module:
        return cnn()

    def datasets(self) -> tuple[Dataset, Dataset]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(self.n, 3, 32, 32, generator=g),
            torch.randint(0, 10, (self.n,), generator=g),
        )
        return data, data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(
    rank: int, world: int, port: int, device: str, ddp: bool, batch: int, steps: int, out
) -> None:
    """One process's timed SGD steps; rank 0 puts the per-step times on `out`."""
    torch.set_num_threads(1)
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if ddp:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = cnn().to(dev)
    if ddp:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    times = []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    if ddp:
        dist.destroy_process_group()
    if rank == 0:
        out.put(times)


def step_time(world: int, device: str, ddp: bool, batch: int, steps: int) -> float:
    """Median seconds per step of rank 0, each rank in its own spawned process."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    args = (world, _free_port(), device, ddp, batch, steps, out)
    mp.start_processes(_steps, args=args, nprocs=world, start_method="spawn")
    return statistics.median(out.get())


def round_time(nproc: int, batch: int, n: int) -> float:
    """Seconds of one WorkerGroup round (1 epoch over n examples), best of 3 rounds."""
    from fedtrain.parallel import WorkerGroup

    state = ModelState.from_module(model_for(BenchTask(n), 1))
    config = {"epochs": 1, "batch_size": batch, "lr": 0.01, "round": 1}
    best = float("inf")
    with WorkerGroup("ddp_bench:BenchTask", {"n": n}, nproc=nproc, threads_per_worker=1) as g:
        for _ in range(1 + 3):  # the first round is a warm-up
            start = time.perf_counter()
            g.train_round(state, config, timeout_s=600)
            best = min(best, time.perf_counter() - start)
    return best


def alternate(repeat: int, one, two) -> tuple[float, float]:
    """Medians of `one()` and `two()` run alternately `repeat` times each."""
    ones, twos = [], []
    for _ in range(repeat):
        ones.append(one())
        twos.append(two())
    return statistics.median(ones), statistics.median(twos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="examples per process per step")
    parser.add_argument("--examples", type=int, default=512, help="site data for the round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="also the GPU mode (needs CUDA)")
    args = parser.parse_args()
    b, steps = args.batch, args.steps
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch.set_num_threads(1) per "
          f"process; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    one, two = alternate(
        args.repeat,
        lambda: step_time(1, "cpu", False, b, steps),
        lambda: step_time(2, "cpu", True, b, steps),
    )
    print(f"CPU step, batch {b}/process: 1 process {one * 1e3:.1f} ms, "
          f"2 processes (DDP, gloo) {two * 1e3:.1f} ms; ratio {two / one:.2f}, "
          f"throughput x{2 * one / two:.2f}")  # fmt: skip
    r1, r2 = alternate(
        args.repeat,
        lambda: round_time(1, b, args.examples),
        lambda: round_time(2, b, args.examples),
    )
    print(f"WorkerGroup round, {args.examples} examples, batch {b}/rank: "
          f"nproc=1 {r1:.2f} s, nproc=2 {r2:.2f} s; speed-up x{r1 / r2:.2f}")  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.gpu:
        if not torch.cuda.is_available():
            print("GPU mode skipped: no CUDA on this machine")
            return
        plain, wrapped = alternate(
            args.repeat,
            lambda: step_time(1, "cuda", False, b, steps),
            lambda: step_time(1, "cuda", True, b, steps),
        )
        print(f"GPU step, batch {b}: plain {plain * 1e3:.2f} ms, DDP-wrapped "
              f"(world 1) {wrapped * 1e3:.2f} ms; ratio {wrapped / plain:.2f}")  # fmt: skip
        if torch.cuda.device_count() >= 2:
            pair = statistics.median(step_time(2, "cuda", True, b, steps) for _ in range(3))
            print(f"GPU step, 2 GPUs DDP: {pair * 1e3:.2f} ms; ratio {pair / plain:.2f}, "
                  f"throughput x{2 * plain / pair:.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
