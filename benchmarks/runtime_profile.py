"""In-process costs of the pieces of a fedtrain server round, and the transport's floor.

The side-by-side benchmark times whole rounds across processes; this module explains
them. At one model size it times, in this process and with fedtrain's own code:

- ``checkpoint``: ``RunDir.save_checkpoint`` (direct I/O write + fsync + rename) every round,
  on its own thread while the next round runs;
- ``begin_round``: allocating and zeroing the FedAvg accumulator;
- ``receive``: one update as the upload handler takes it, chunk by chunk: placement
  checks, finiteness and the journal (in memory, within ``upload_memory_mb``);
  ``receive_disk``: the same with the journal on disk (``upload_memory_mb = 0``, or
  past the budget);
- ``commit``: folding the whole update into the round's sum from its journal, once
  it is complete (``commit_disk``: from a journal on disk, in the page cache): the
  part of an upload that runs after its last byte arrived;
- ``check_finite``: the per-chunk NaN/Inf check over one update, sum-first (current)
  and element-wise ``isfinite`` (what it was before), to show what that change saved;
- ``grpc_upload``/``grpc_download``: raw Python gRPC throughput over loopback for
  one model's bytes in ``chunk_bytes`` messages, no fedtrain code at all: the floor
  under any gRPC-based runtime in Python on this machine.

Each is the best of ``repeat`` runs (the machine is shared; the minimum is the
least disturbed). Model-sized buffers are allocated once up front.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.grpc_floor import channel_options, raw_handler
from fedtrain.run_dir import RunDir
from fedtrain.runtime.server.uploads import MemoryBudget, UpdateSpool
from fedtrain.strategy.aggregate import check_finite
from fedtrain.strategy.fedavg import FedAvg
from fedtrain.tensors import DEFAULT_CHUNK_BYTES, ModelState

__all__ = ["profile_server_pieces"]


def _best(fn: Callable[[], Any], repeat: int) -> float:
    """Minimum wall seconds of ``repeat`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _elementwise_finite(values: torch.Tensor) -> bool:
    """The check as it was before the sum-first change (for comparison only)."""
    return bool(torch.isfinite(values).all())


def _grpc_throughput(total_bytes: int, chunk_bytes: int, repeat: int) -> tuple[float, float]:
    """Seconds to stream ``total_bytes`` up and down over loopback gRPC (best of ``repeat``)."""
    messages = max(1, total_bytes // chunk_bytes)
    payload = bytes(chunk_bytes)
    options = channel_options(chunk_bytes)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    server.add_generic_rpc_handlers((raw_handler(total_bytes, chunk_bytes),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            up = channel.stream_unary("/floor/Up")
            down = channel.unary_stream("/floor/Down")
            t_up = _best(lambda: up(iter([payload] * messages)), repeat)
            t_down = _best(lambda: sum(len(m) for m in down(b"")), repeat)
    finally:
        server.stop(0)
    return t_up, t_down


def profile_server_pieces(
    num_params: int, workdir: Path, *, repeat: int = 2, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[str, float]:
    """Seconds per piece (see the module docstring) for a ``num_params`` float32 model."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = _server_pieces(num_params, workdir, repeat, chunk_bytes)  # its buffers are freed
    out["grpc_upload"], out["grpc_download"] = _grpc_throughput(num_params * 4, chunk_bytes, repeat)
    return out


def _server_pieces(
    num_params: int, workdir: Path, repeat: int, chunk_bytes: int
) -> dict[str, float]:
    """The fedtrain pieces; model-sized buffers live only for this call."""
    model = ModelState({"weights": torch.zeros(num_params)})
    update = ModelState({"weights": torch.full((num_params,), 0.001)})
    chunks = list(update.chunks(chunk_bytes))
    strategy = FedAvg()
    out: dict[str, float] = {}
    run_dir = RunDir(Path(tempfile.mkdtemp(dir=workdir, prefix="ckpt-")))
    out["checkpoint"] = _best(lambda: run_dir.save_checkpoint(1, model, {}, {"x": 1}), repeat)
    out["begin_round"] = _best(lambda: strategy.begin_round(1, model), repeat)
    aggregate = strategy.begin_round(1, model)

    def receive(memory: MemoryBudget) -> tuple[float, float]:
        """(seconds to receive one update, seconds to fold it in at commit)."""
        with UpdateSpool(model.specs, workdir, chunk_bytes, memory) as spool:
            start = time.perf_counter()
            for chunk in chunks:
                spool.add(chunk)
            spool.finish()
            mid = time.perf_counter()
            spool.fold_into(aggregate, 1.0)
            return mid - start, time.perf_counter() - mid

    in_memory = [receive(MemoryBudget(update.nbytes)) for _ in range(repeat)]
    on_disk = [receive(MemoryBudget(0)) for _ in range(repeat)]
    out["receive"] = min(t[0] for t in in_memory)
    out["commit"] = min(t[1] for t in in_memory)
    out["receive_disk"] = min(t[0] for t in on_disk)
    out["commit_disk"] = min(t[1] for t in on_disk)
    values = update["weights"]
    step = chunk_bytes // 4
    pieces = [values[i : i + step] for i in range(0, num_params, step)]
    out["check_finite"] = _best(lambda: [check_finite("w", p) for p in pieces], repeat)
    out["check_finite_elementwise"] = _best(
        lambda: [_elementwise_finite(p) for p in pieces], repeat
    )
    return out
