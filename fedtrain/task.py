"""The site-side API: what a site trains, on which data, and how.

A `Task` is a model factory, the site's data, a train step and an evaluation. The
same task object runs in a site daemon, under DDP, and in simulation, so it never
touches networks or processes. `TorchTask` is the default loop (optimizer, loss,
local epochs, batch size, learning rate and device from the round config): a simple
task is a model plus datasets.
"""

from __future__ import annotations

import fnmatch
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from fedtrain.errors import ConfigError, TaskError
from fedtrain.references import import_reference
from fedtrain.strategy.base import RoundConfig
from fedtrain.tensors import ModelState, TensorSpec, dtype_name


@dataclass(frozen=True)
class TrainResult:
    """What local training reports: the weight of the update and free-form metrics."""

    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalResult:
    """What evaluation reports; `metrics` holds e.g. accuracy."""

    num_examples: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskContext:
    """Where and as whom a task runs. Under DDP, rank/world_size describe the group.

    Every rank of a group gets the site's whole dataset and the same `client_id` and
    `seed`, so all ranks draw the same shuffle; each trains on its shard of it
    (`iterate_batches(..., rank=, world_size=)`) and reports the site's total count.
    """

    device: torch.device = torch.device("cpu")
    client_id: str = "local"
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    #: This client's own state from its previous rounds, for algorithms that keep some
    #: at the site (control variates, error-feedback residuals, personal layers). Train
    #: may read and replace its entries (CPU tensors); the driver keeps what is left for
    #: the client's next round and stores nothing for clients that leave it empty.
    #: None where the driver keeps no client state.
    client_state: dict[str, torch.Tensor] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a group of {self.world_size}")


@dataclass(frozen=True)
class SiteData:
    """A site's private data: a training set and an optional evaluation set."""

    train: Dataset
    test: Dataset | None = None


def resolve_device(name: str) -> torch.device:
    """A config device string as a torch.device, with a clear error when it is absent."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device = {name!r} is not a device name ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f'device = {name!r} but this machine has no CUDA GPU; set device = "cpu"'
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device = {name!r} but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    return device


class Task(ABC):
    """A federated learning task. Subclass it, or `TorchTask` for the default loop."""

    #: Bump when the model or the training code changes in a way peers must agree on;
    #: it is part of the fingerprint that the server checks.
    version: ClassVar[str] = "1"

    #: Which of the model's tensors are federated (downloaded, uploaded, aggregated,
    #: checkpointed): "all"; "trainable" (the parameters that require grad, e.g. LoRA
    #: adapters over a frozen base); or a tuple of glob patterns over state-dict names.
    #: The rest (the frozen base) never travels: every site must hold the same, so the
    #: fingerprint covers it (`base_revision`, else a hash of its tensors).
    federated: str | tuple[str, ...] = "all"

    def base_revision(self) -> str | None:
        """A declared identity of the frozen base (a model revision, a checkpoint's
        hash) that the fingerprint takes instead of hashing the base's tensors, which
        costs a pass over a large model at every start. None: hash them."""
        return None

    @abstractmethod
    def model(self) -> nn.Module:
        """A fresh model. Called under a fixed torch seed where determinism matters."""

    @abstractmethod
    def datasets(self) -> tuple[Dataset, Dataset | None]:
        """The task's whole train and test data (simulation partitions the train set)."""

    def labels(self, dataset: Dataset) -> torch.Tensor:
        """Class labels of a dataset, for label-skew partitioning."""
        base, index = _unwrap(dataset)
        if isinstance(base, TensorDataset) and len(base.tensors) >= 2:
            y = base.tensors[-1]
            return y if index is None else y[index]
        raise TaskError(
            f"{type(self).__name__}.labels() cannot read labels from a "
            f"{type(dataset).__name__}; override labels() to return them"
        )

    def client_test_data(self, data: Dataset) -> Dataset | None:
        """The held-out set of a simulated client whose training share is `data`, used
        for federated evaluation when `eval_fraction` holds none out. Default: none; a
        task whose clients keep their own test data (a Flower client's `evaluate`)
        returns `data`. (A deployment site's held-out set comes from its site.toml or
        its `site_data` hook.)"""
        return None

    def export_names(self) -> Mapping[str, str]:
        """State-dict name -> the name exported model files give that tensor, for the
        names that differ (`fedtrain.export`); a wrapper whose module cannot carry the
        real names (Flower's arrays p0, p1, ...) maps them back. Default: none differ."""
        return {}

    @abstractmethod
    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        """Train `model` in place on `data`; report the number of examples used."""

    @abstractmethod
    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        """Evaluate `model` on `data` without changing it."""


class TorchTask(Task):
    """The default supervised loop: SGD over mini-batches with a classification loss.

    Round config keys it reads (all optional): `epochs` (1), `batch_size` (32),
    `lr` (0.01), `momentum` (0.0), `weight_decay` (0.0), `proximal_mu` (0.0: FedProx's
    mu/2 * ||w - w_global||^2 term when > 0), `round` (for seeding the shuffle).
    Override `loss` or `optimizer` for other objectives.

    Under DDP (`context.world_size > 1`, `model` is the DDP-wrapped module) the same
    loop trains on this rank's shard of every epoch's shuffle, `batch_size` per rank,
    and `train_loss` is averaged over all ranks' examples.
    """

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def optimizer(self, model: nn.Module, config: RoundConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            model.parameters(),
            lr=float(config.get("lr", 0.01)),
            momentum=float(config.get("momentum", 0.0)),
            weight_decay=float(config.get("weight_decay", 0.0)),
        )

    def train(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> TrainResult:
        epochs, batch_size, gen = local_loop(config, context, default_batch_size=32)
        model.to(context.device).train()
        opt = self.optimizer(model, config)
        mu = float(config.get("proximal_mu", 0.0))
        anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else []
        total_loss, seen = 0.0, 0
        for _ in range(epochs):
            batches = iterate_batches(
                data,
                batch_size,
                shuffle=True,
                generator=gen,
                rank=context.rank,
                world_size=context.world_size,
            )
            for x, y in batches:
                x, y = x.to(context.device), y.to(context.device)
                opt.zero_grad(set_to_none=True)
                loss = self.loss(model(x), y)
                if anchor:  # FedProx: stay near the global model the round started from
                    loss = loss + mu / 2 * proximal_term(model, anchor)
                loss.backward()
                opt.step()
                total_loss += float(loss.detach()) * len(y)
                seen += len(y)
        if context.world_size > 1:
            total_loss, seen = sum_over_ranks((total_loss, seen), context.device)
        return TrainResult(len(data), {"train_loss": total_loss / max(seen, 1)})

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: Dataset, config: RoundConfig, context: TaskContext
    ) -> EvalResult:
        model.to(context.device).eval()
        total_loss, correct, n, classifies = 0.0, 0, 0, False
        for x, y in iterate_batches(data, int(config.get("eval_batch_size", 1024))):
            x, y = x.to(context.device), y.to(context.device)
            out = model(x)
            total_loss += float(self.loss(out, y)) * len(y)
            if out.dim() == 2 and out.shape[1] > 1:
                classifies = True
                correct += int((out.argmax(dim=1) == y).sum())
            n += len(y)
        metrics = {"accuracy": correct / n} if n and classifies else {}
        return EvalResult(n, total_loss / max(n, 1), metrics)


def local_loop(
    config: RoundConfig, context: TaskContext, default_batch_size: int
) -> tuple[int, int, torch.Generator]:
    """A local training loop's `epochs`, `batch_size` and shuffle generator, from the
    round config (checked) and the context: every rank of a site draws the same order."""
    epochs = int(config.get("epochs", 1))
    batch_size = int(config.get("batch_size", default_batch_size))
    if epochs < 1 or batch_size < 1:
        raise ConfigError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    seed = mix_seed(context.seed, int(config.get("round", 0)), context.client_id)
    return epochs, batch_size, torch.Generator().manual_seed(seed)


def proximal_term(model: nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """||w - w_anchor||^2 over the model's parameters (FedProx's regulariser)."""
    return sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))  # type: ignore[return-value]


def iterate_batches(
    data: Dataset,
    batch_size: int,
    *,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Mini-batches of a dataset, or of rank `rank`'s shard of it.

    In-memory tensor datasets (and subsets of them) are sliced directly, which is
    an order of magnitude faster than DataLoader's per-item collation and matters
    when one process simulates thousands of clients. Anything else goes through a
    DataLoader with the same seeded order.

    Sharding follows `DistributedSampler(drop_last=False)`: every rank draws the same
    order (same generator state), it is padded by repeating its first examples up
    to a multiple of `world_size`, and rank r takes positions r, r + world_size, ...
    So all ranks get the same number of batches (DDP needs that), a few examples
    may be seen twice per epoch, and batch k of all ranks together is block k of
    `world_size * batch_size` examples of the padded order: exactly what one process
    with the larger batch would see.
    """
    n = len(data)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    if world_size > 1:
        order = _shard(order, rank, world_size)
        n = len(order)
    base, index = _unwrap(data)
    if isinstance(base, TensorDataset):
        if index is not None:
            order = index[order]
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            yield tuple(t[rows] for t in base.tensors)
        return
    loader = DataLoader(Subset(data, order.tolist()), batch_size=batch_size, shuffle=False)
    yield from loader


def _shard(order: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s positions of `order`, padded as DistributedSampler does."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a group of {world_size}")
    pad = -len(order) % world_size
    if pad and len(order):
        repeats = -(-pad // len(order))
        order = torch.cat([order, order.repeat(repeats)[:pad]])
    return order[rank::world_size]


def sum_over_ranks(values: tuple[float, ...], device: torch.device) -> tuple[float, ...]:
    """Element-wise sum over the DDP group (as-is when no process group is running)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return tuple(t.tolist())


def _unwrap(data: Dataset) -> tuple[Dataset, torch.Tensor | None]:
    """(base dataset, index tensor into it) through nested Subsets."""
    index: torch.Tensor | None = None
    while isinstance(data, Subset):
        idx = torch.as_tensor(data.indices, dtype=torch.long)
        index = idx if index is None else idx[index]
        data = data.dataset
    return data, index


def mix_seed(*parts: object) -> int:
    """A stable 63-bit seed from several parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def model_for(task: Task, seed: int) -> nn.Module:
    """The task's model, initialised under `seed` (same weights in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.model()


def federated_names(task: Task, model: nn.Module) -> tuple[str, ...] | None:
    """The state-dict names of `model` that travel, in state-dict order (`Task.federated`);
    None when all of them do (the common case: no filtering anywhere)."""
    rule = task.federated
    if rule == "all":
        return None
    names = list(model.state_dict())
    if rule == "trainable":
        trainable = {
            n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        chosen = [n for n in names if n in trainable]
    elif isinstance(rule, (tuple, list)) and all(isinstance(p, str) for p in rule):
        chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in rule)]
    else:
        raise ConfigError(
            f'{type(task).__name__}.federated = {rule!r}: use "all", "trainable" or a '
            "tuple of glob patterns over the model's state-dict names"
        )
    if not chosen:
        raise ConfigError(
            f"{type(task).__name__}.federated = {rule!r} selects none of the model's "
            f"{len(names)} tensors (e.g. {names[:3]}); nothing would be trained together"
        )
    return tuple(chosen)


def task_fingerprint(task: Task, model: nn.Module | None = None) -> str:
    """Identity of a task that server and sites must share: code path, version, model
    shape and, when only part of the model is federated, the frozen rest.

    The server never ships code; a site whose installed task differs is refused
    with a message naming both fingerprints. `model`: the model this process trains
    (default: the task's model under seed 0); a frozen base that depends on the seed
    differs between processes with different seeds, and is refused as it should be.
    """
    model = model if model is not None else model_for(task, 0)
    own = model.state_dict()
    spec = tuple(  # shapes only: no copy of the model's tensors (it may be large)
        TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in own.items()
    )
    cls = type(task)
    text = f"{cls.__module__}:{cls.__qualname__}|{task.version}|{spec}"
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
    names = federated_names(task, model)
    if names is not None:  # a second part, so a mismatch can say which half differs
        base = f"federated={names}|base={base_identity(task, model, names)}"
        fingerprint += BASE_MARK + hashlib.sha256(base.encode()).hexdigest()[:16]
    return fingerprint


#: Separates a fingerprint's task half from its frozen-base half.
BASE_MARK = "+base:"


def fingerprint_mismatch(site: str, server: str) -> str:
    """What differs between two task fingerprints, in words an operator can act on."""
    site_task, _, site_base = site.partition(BASE_MARK)
    server_task, _, server_base = server.partition(BASE_MARK)
    if site_task == server_task and site_base and server_base:
        return (
            f"the site's frozen base model differs from the server's (base {site_base} vs "
            f"{server_base}): every site must load the same base weights (the same "
            "checkpoint or revision) as the server"
        )
    return (
        f"the site runs task fingerprint {site or '(none)'}, the server {server}: install "
        "the same task code, version and options at the site"
    )


def base_identity(task: Task, model: nn.Module, federated: tuple[str, ...]) -> str:
    """The frozen base's identity: the task's declared revision, else a SHA-256 of
    every tensor that does not travel."""
    revision = task.base_revision()
    if revision is not None:
        return f"revision:{revision}"
    kept = set(federated)
    frozen = {n: t for n, t in model.state_dict().items() if n not in kept}
    return "sha256:" + ModelState(frozen).digest()


def load_task(ref: str, options: Mapping[str, Any] | None = None) -> Task:
    """Import a task from `"package.module:ClassName"` and build it with `options`."""
    factory = import_reference(ref, "task", "ClassName")
    try:
        task = factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"task = {ref!r}: bad task options: {exc}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task = {ref!r} built a {type(task).__name__}, not a fedtrain Task")
    return task
