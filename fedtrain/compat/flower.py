"""Run an existing Flower `NumPyClient`, unchanged, as a fedtrain task.

Migration from Flower is a config change, not a rewrite:

    task = "fedtrain.compat.flower:FlowerTask"
    [task_options]
    client_fn = "myapp.client_app:client_fn"   # the function your ClientApp already uses
    num_partitions = 10

`client_fn` may take a Flower `Context` (its `node_config` carries "partition-id" and
"num-partitions", as in a Flower simulation) or, in the legacy style, a client id
string. The client's arrays travel as buffers `p0, p1, ...` of a parameter-free
module, so everything fedtrain does to a model (chunked transport, FedAvg, secure
aggregation, checkpoints) applies unchanged. Each virtual client or site is one
partition: the training "dataset" fedtrain partitions is the list of partition ids.

In a deployment each site names its partition the way `flower-supernode
--node-config "partition-id=0 num-partitions=2"` does, in site.toml:

    [data]
    source = "task"
    options = { "partition-id" = 0 }    # the client's Context.node_config (any keys)

The server builds the client of partition 0 once, only to read the initial arrays
(`get_parameters`); it never calls `fit` or `evaluate` there.

A NumPyClient's arrays have no names, so exported model files (`fedtrain export`,
`model.safetensors`) would call them p0, p1, ...; `parameter_names` gives them the
app's own names, in `get_parameters` order: a list, or "package.module:function"
returning one (e.g. `[k for k in Net().state_dict()]`, or a Keras model's
`[w.path for w in model.weights]`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from fedtrain.errors import ConfigError, TaskError
from fedtrain.task import EvalResult, Task, TaskContext, TrainResult


class ArrayModule(nn.Module):
    """A module made of a Flower client's arrays (buffers p0..pN, no parameters)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__()
        for i, a in enumerate(arrays):
            self.register_buffer(f"p{i}", torch.from_numpy(np.array(a, copy=True)))

    def arrays(self) -> list[np.ndarray]:
        return [b.detach().cpu().numpy() for b in self.buffers()]

    def load_arrays(self, arrays: list[np.ndarray]) -> None:
        own = list(self.buffers())
        if len(arrays) != len(own):
            raise TaskError(
                f"Flower client returned {len(arrays)} arrays, the model has {len(own)}"
            )
        with torch.no_grad():
            for i, (buf, a) in enumerate(zip(own, arrays, strict=True)):
                new = torch.from_numpy(np.asarray(a))
                if new.shape != buf.shape or new.dtype != buf.dtype:
                    raise TaskError(
                        f"Flower client returned array {i} as {new.dtype} {tuple(new.shape)}, "
                        f"expected {buf.dtype} {tuple(buf.shape)}"
                    )
                buf.copy_(new)


class PartitionIds(Dataset):
    """The "training set" fedtrain partitions: one item per Flower partition id."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(index)
        return index


def _resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ConfigError(f"client_fn = {ref!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"client_fn = {ref!r} cannot be loaded: {exc}") from None


class FlowerTask(Task):
    """A Flower NumPyClient factory as a fedtrain Task (see the module docstring)."""

    def __init__(
        self,
        client_fn: str | Callable[..., Any],
        num_partitions: int,
        run_config: dict[str, Any] | None = None,
        parameter_names: list[str] | str | None = None,
    ) -> None:
        if num_partitions < 1:
            raise ConfigError(f"num_partitions must be >= 1, got {num_partitions}")
        self.client_fn = _resolve(client_fn)
        self.num_partitions = num_partitions
        self.run_config = dict(run_config or {})
        self.parameter_names = parameter_names
        ref = client_fn if isinstance(client_fn, str) else self.client_fn.__qualname__
        self.version = f"flower:{ref}"  # part of the fingerprint sites must share
        self._clients: dict[int, Any] = {}
        #: node_config of the partition a deployment site holds (`site_data`).
        self._node_configs: dict[int, dict[str, Any]] = {}
        self._home = 0  # the partition whose client provides `model()`

    def client(self, partition_id: int) -> Any:
        """The NumPyClient of one partition, built once and kept (clients may be stateful)."""
        if partition_id not in self._clients:
            self._clients[partition_id] = self._build(partition_id)
        return self._clients[partition_id]

    def _build(self, partition_id: int) -> Any:
        params = list(inspect.signature(self.client_fn).parameters)
        if params and params[0] in ("context", "ctx"):
            from flwr.common import Context, RecordDict

            node_config = {
                "partition-id": partition_id,
                "num-partitions": self.num_partitions,
                **self._node_configs.get(partition_id, {}),
            }
            context = Context(
                run_id=0,
                node_id=partition_id,
                node_config=node_config,
                state=RecordDict(),
                run_config=self.run_config,
            )
            client = self.client_fn(context)
        else:
            client = self.client_fn(str(partition_id))
        client = getattr(client, "numpy_client", client)  # `.to_client()` wraps it
        for method in ("get_parameters", "fit", "evaluate"):
            if not callable(getattr(client, method, None)):
                raise TaskError(f"client_fn returned {type(client).__name__}, not a NumPyClient")
        return client

    def model(self) -> nn.Module:
        return ArrayModule(self.client(self._home).get_parameters({}))

    def datasets(self) -> tuple[Dataset, None]:
        return PartitionIds(self.num_partitions), None

    def site_data(self, site_name: str, **node_config: Any) -> Dataset:
        """A deployment site's data: the one partition its node_config names (see the
        module docstring); the client_fn's Context gets that node_config."""
        partition_id = node_config.get("partition-id")
        if isinstance(partition_id, bool) or not isinstance(partition_id, int):
            raise ConfigError(
                f"site {site_name!r}: data.options must name this site's Flower partition, "
                'e.g. options = { "partition-id" = 0 } (got '
                f"{partition_id!r}); it is what `flower-supernode --node-config` passed"
            )
        if not 0 <= partition_id < self.num_partitions:
            raise ConfigError(
                f"site {site_name!r}: partition-id = {partition_id} must be in "
                f"[0, {self.num_partitions}) (task_options.num_partitions)"
            )
        self._node_configs[partition_id] = dict(node_config)
        self._home = partition_id  # the site builds only its own client
        return Subset(PartitionIds(self.num_partitions), [partition_id])

    def export_names(self) -> Mapping[str, str]:
        """p0, p1, ... -> `parameter_names` (see the module docstring)."""
        names = self.parameter_names
        if names is None:
            return {}
        if isinstance(names, str):
            names = _resolve(names)()
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"parameter_names must be a list of names or 'module:function' returning one, "
                f"got {names!r}"
            )
        return {f"p{i}": name for i, name in enumerate(names)}

    def labels(self, dataset: Dataset) -> torch.Tensor:
        raise TaskError(
            "a Flower client keeps its own data, so label-skew partitioning cannot see labels; "
            'use partition.kind = "iid" with num_clients == num_partitions'
        )

    def _partition(self, data: Dataset) -> int:
        if len(data) != 1 or not isinstance(data[0], int):  # type: ignore[arg-type]
            raise ConfigError(
                f"each client must hold exactly one Flower partition (got {len(data)}); "  # type: ignore[arg-type]
                "set num_clients equal to the task's num_partitions"
            )
        return int(data[0])

    @staticmethod
    def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}

    def train(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> TrainResult:
        assert isinstance(model, ArrayModule)
        arrays, num_examples, metrics = self.client(self._partition(data)).fit(
            model.arrays(), dict(config)
        )
        model.load_arrays(arrays)
        return TrainResult(int(num_examples), self._numeric(metrics))

    def evaluate(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> EvalResult:
        assert isinstance(model, ArrayModule)
        loss, num_examples, metrics = self.client(self._partition(data)).evaluate(
            model.arrays(), dict(config)
        )
        return EvalResult(int(num_examples), float(loss), self._numeric(metrics))
