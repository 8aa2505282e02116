"""Intra-site data parallelism: one site trains each round on all its GPUs (torch DDP).

A site daemon starts a worker group once and keeps it across rounds. Each round the
global model goes to every rank, every rank trains on its shard of the site's data
with DDP all-reducing the gradients, and rank 0's trained model comes back with the
site's total example count. The daemon deals with the group object only; it joins
no collective itself, so it keeps talking to the server whatever a worker does.

One machine (`WorkerGroup`)::

    group = WorkerGroup(
        "fedtrain.examples:DigitsTask", {}, data=functools.partial(site_dataset, ...),
        seed=site_seed, client_id=site_name, devices=["cuda:0", "cuda:1"],  # or nproc=2
    )
    with group:                                  # spawns the workers, waits until ready
        local, result = group.train_round(global_state, config, timeout_s=3600)
        delta = compute_delta(local, global_state)  # weight: result.num_examples

- Workers are `torch.multiprocessing` spawn processes (rank r on `devices[r]`; NCCL
  between GPUs, gloo between CPU processes with `threads_per_worker` torch threads,
  default cores // nproc). They rendezvous on a TCPStore that the daemon hosts on
  127.0.0.1 at a port the OS picks. The global model enters and the trained model
  leaves through one shared-memory block (rank 0); ranks exchange tensors only with
  torch.distributed (broadcast of the global weights from rank 0, DDP's all-reduce).
- Every rank builds the task, the site's whole dataset (`data(task)`, default
  `task.datasets()[0]`) and the model. `TorchTask.train` runs unchanged: it gets the
  DDP-wrapped model and `TaskContext(rank=, world_size=)`, and `iterate_batches`
  shards each epoch's shuffle like `DistributedSampler(drop_last=False)`: all ranks
  draw the same permutation (same seed, round and client id), it is padded by
  repeating its first examples to a multiple of the world size, and rank r takes
  every world_size-th example from position r. A custom task receives the same
  context and must shard the same way and report the site's total count.
- Failures: a rank that crashes, raises, or stays silent past `timeout_s` fails that
  round with `WorkerGroupError` (which rank, what happened, "being restarted"); the
  group kills every worker's process tree and spawns fresh ones for the next round.
- Shutdown: `close()` stops the workers (politely, then SIGKILL). Workers lead their
  own process group (a terminal's Ctrl-C reaches only the daemon) and kill that group
  when the daemon dies, even by SIGKILL; an atexit hook closes groups left open.

A site spanning machines (torchrun's launch contract)::

    # on every machine of the site: --node-rank 0 on HOST0, 1 on the other
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 \\
        --master-addr HOST0 --master-port 29500 --no-python fedtrain client --config site.toml

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every
process. The process with RANK 0 is the daemon and uses `WorkerGroup.from_env(...)`
(same arguments as `WorkerGroup`, without nproc/devices: rank r uses cuda:LOCAL_RANK,
or the CPU); every other process calls `follower_main(...)` with the same task, data,
seed and client id (the same site.toml; every machine must see the same site data,
since each rank builds the whole dataset and trains its shard), and exits when rank 0
closes the group::

    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        sys.exit(follower_main(task_ref, task_options, data=..., seed=..., client_id=...))
    group = WorkerGroup.from_env(task_ref, task_options, data=..., seed=..., client_id=...)

Only rank 0 talks to the server. torchrun owns these processes, so a failed round
cannot restart in place: it raises `WorkerGroupError(restarting=False)`, and the
daemon should exit so that torchrun (`--max-restarts`) restarts the site.

Simulation uses `placement.assign_devices` to spread virtual clients over GPUs.
"""

from fedtrain.errors import WorkerGroupError
from fedtrain.parallel.group import WorkerGroup
from fedtrain.parallel.launch import TorchrunGroup, follower_main, launched_by_torchrun
from fedtrain.parallel.placement import assign_devices, slots, visible_devices
from fedtrain.parallel.rank import DataFactory, GroupSpec

__all__ = [
    "DataFactory",
    "GroupSpec",
    "TorchrunGroup",
    "WorkerGroup",
    "WorkerGroupError",
    "assign_devices",
    "follower_main",
    "launched_by_torchrun",
    "slots",
    "visible_devices",
]
