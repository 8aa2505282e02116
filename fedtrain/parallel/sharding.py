"""A model sharded across a site's ranks (FSDP2), and its federated tensors in and out.

A base model larger than one device is sharded with `torch.distributed.fsdp.fully_shard`
across the ranks of the site's worker group: each block of the model (every child of
its `nn.ModuleList`s, e.g. a transformer's layers) is one unit, so a rank holds 1/N of
every weight and gathers one block at a time in forward and backward. Gradients are
reduce-scattered as DDP's are all-reduced: a step on N ranks, each on its shard of the
batch, is the step one process takes on the whole batch.

Only the federated tensors cross the group's boundary: `scatter_federated` hands rank
0's global state to every rank's shards (a broadcast), `gather_federated` collects
the full tensors on rank 0 for upload, one tensor at a time. Both are collectives:
every rank calls them, in the same order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fedtrain.errors import TensorStreamError
from fedtrain.tensors import select

SHARDINGS = ("ddp", "fsdp")


def blocks(module: nn.Module) -> list[nn.Module]:
    """The units to shard one by one: every child of every ModuleList in `module`."""
    return [
        block for m in module.modules() if isinstance(m, nn.ModuleList) for block in m.children()
    ]


def shard_module(module: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """`module` sharded in place across the `world_size` ranks of the process group."""
    mesh = init_device_mesh(device.type, (world_size,))
    for block in blocks(module):
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def gather_federated(
    module: nn.Module, names: Collection[str] | None, rank: int
) -> dict[str, torch.Tensor] | None:
    """The full federated tensors on rank 0 (CPU); None on the other ranks."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in select(module.state_dict(), names).items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            out[name] = full.detach().to("cpu", copy=True)
    return out if rank == 0 else None


def scatter_federated(
    module: nn.Module,
    state: Mapping[str, torch.Tensor] | None,
    names: Collection[str] | None,
    rank: int,
) -> None:
    """Rank 0's `state` (exactly the federated tensors) into every rank's shards."""
    if rank == 0:
        if state is None:
            raise ValueError("rank 0 needs the global state")
        expected = set(select(module.state_dict(), names))
        if set(state) != expected:
            raise TensorStreamError(
                f"state does not match the sharded model: missing {sorted(expected - set(state))}"
                f", unexpected {sorted(set(state) - expected)}"
            )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(module, dict(state) if rank == 0 and state else {}, options=options)
    if dist.is_initialized():
        dist.barrier()


def local_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds (its shards, when sharded)."""
    total = 0
    for t in module.state_dict().values():
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
