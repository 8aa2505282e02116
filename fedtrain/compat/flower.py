"""Run an existing Flower client, unchanged, as a fedtrain task.

Migration from Flower is a config change, not a rewrite. Two kinds of Flower client
run: a `NumPyClient` built by a `client_fn` (here, `FlowerTask`), and a Message-API
`ClientApp` with `@app.train()` / `@app.evaluate()` functions, as Flower's current
quickstarts are written (`fedtrain.compat.flower_app.FlowerClientApp`):

    task = "fedtrain.compat.flower:FlowerTask"
    [task_options]
    client_fn = "myapp.client_app:client_fn"   # the function your ClientApp already uses
    num_partitions = 10
    model = "myapp.task:Net"                     # optional: keep the state_dict's names
    [task_options.run_config]                    # Context.run_config ([tool.flwr.app.config])
    local-epochs = 1

`client_fn` may take a Flower `Context` (its `node_config` carries "partition-id" and
"num-partitions", as in a Flower simulation) or, in the legacy style, a client id
string. Without `model`, the client's arrays travel as buffers `p0, p1, ...` of a
parameter-free module; with it, as the named tensors of that module's state_dict (in
its order, the order Flower's examples exchange arrays in). Either way everything
fedtrain does to a model (chunked transport, FedAvg, secure aggregation,
checkpoints) applies unchanged. Each virtual client or site is one partition: the
training "dataset" fedtrain partitions is the list of partition ids.

In a deployment each site names its partition the way `flower-supernode
--node-config "partition-id=0 num-partitions=2"` does, in site.toml:

    [data]
    source = "task"
    options = { "partition-id" = 0 }    # the client's Context.node_config (any keys)

Without a test set on the server (the default: `evaluate = false`) the global model
is evaluated where the data is, as Flower's federated evaluation does: each site
(each simulated client) calls its NumPyClient's `evaluate()`, and metrics.jsonl gets
the example-weighted `loss`/`accuracy` and each site's (`fedtrain.evaluation`).

Without `model`, the server builds the client of partition 0 once, only to read the
initial arrays (`get_parameters`); it never calls `fit` or `evaluate` there.

Without `model`, a NumPyClient's arrays have no names, so exported model files
(`fedtrain export`, `model.safetensors`) would call them p0, p1, ...; `parameter_names`
gives them the app's own names, in `get_parameters` order: a list, or
"package.module:function" returning one (e.g. `[k for k in Net().state_dict()]`, or a
Keras model's `[w.path for w in model.weights]`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from fedtrain.config import load_toml
from fedtrain.errors import ConfigError, TaskError
from fedtrain.references import import_reference
from fedtrain.strategy.base import weighted_metrics
from fedtrain.task import EvalResult, SiteData, Task, TaskContext, TrainResult

#: The Flower app settings `run_config` reads, from the app's own pyproject.toml.
APP_CONFIG_TABLE = ("tool", "flwr", "app", "config")


class MissingKey(ConfigError, KeyError):
    """A Flower app looked up a config key nobody set. Still a KeyError, so an app that
    catches KeyError keeps working; a ConfigError, so the CLI prints one clear line."""

    def __str__(self) -> str:
        return str(self.args[0])


class RunConfig(dict):
    """`Context.run_config`: a dict whose missing keys name the option that sets them."""

    def __missing__(self, key: str) -> Any:
        raise MissingKey(
            f"the Flower app reads run_config[{key!r}], which is not set: add it to "
            f"[task_options.run_config] (e.g. {key} = ...), or point task_options.app_config "
            "at the app's pyproject.toml, whose [tool.flwr.app.config] sets it; set: "
            f"{sorted(self) or 'nothing'}"
        )


class RoundConfigDict(dict):
    """A NumPyClient's `fit`/`evaluate` config: missing keys name `[client]`."""

    def __missing__(self, key: str) -> Any:
        raise MissingKey(missing_round_config(key, self))


def missing_round_config(key: str, config: Mapping[str, Any]) -> str:
    return (
        f"the Flower app reads {key!r} from the round's config, which is not set: add "
        f"{key} = ... to [client] in sim.toml / server.toml (or schedule it in "
        f"[client_schedule.{key}]); the round's config holds {sorted(config)}"
    )


def load_run_config(app_config: str, run_config: Mapping[str, Any] | None) -> RunConfig:
    """Flower's run config: the app's `[tool.flwr.app.config]` (when `app_config`
    names its pyproject.toml) overridden by `run_config`, as `flwr run --run-config`
    overrides it; nested tables flatten to dotted keys as Flower flattens them."""
    merged: dict[str, Any] = {}
    if app_config:
        table: Any = load_toml(Path(app_config))
        for part in APP_CONFIG_TABLE:
            table = table.get(part, {}) if isinstance(table, dict) else {}
        merged.update(_flatten(table))
    merged.update(_flatten(dict(run_config or {})))
    for key, value in merged.items():
        if not isinstance(value, bool | int | float | str):
            raise ConfigError(
                f"task_options.run_config.{key} = {value!r}: Flower run config values are "
                "booleans, numbers or strings"
            )
    return RunConfig(merged)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class ModuleFactory:
    """Builds the app's torch model (e.g. its `Net` class) from `task_options.model`.

    It keeps the reference, not the resolved class, so a task holding it pickles (the
    process and Ray backends send the task to their workers).
    """

    def __init__(self, ref: str | Callable[[], Any], key: str) -> None:
        self.ref, self.key = ref, key
        self.factory()  # a bad reference fails when the config is read

    def factory(self) -> Callable[[], Any]:
        return self.ref if callable(self.ref) else import_reference(self.ref, self.key, "ClassName")

    def __call__(self) -> nn.Module:
        try:
            module = self.factory()()
        except TypeError as exc:
            raise ConfigError(
                f"{self.key} = {self.ref!r} cannot build the model without arguments ({exc}); "
                "name the model's class (e.g. 'myapp.task:Net') or a function that returns it"
            ) from None
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"{self.key} = {self.ref!r} built a {type(module).__name__}, not a torch.nn.Module"
            )
        return module


class ArrayModule(nn.Module):
    """A module made of a Flower client's arrays (buffers p0..pN, no parameters)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__()
        for i, a in enumerate(arrays):
            self.register_buffer(f"p{i}", torch.from_numpy(np.array(a, copy=True)))


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


class FlowerPartitions(Task):
    """What every Flower client kind shares: one Flower partition per fedtrain client,
    a Flower `Context` per partition (kept across rounds, as a SuperNode keeps it),
    and deployment sites that name their partition in site.toml.

    With `evaluate`, the task's "test set" is every partition: fedtrain's evaluation
    of the global model (the simulation's; a deployment server's, which must then be
    able to load every partition) asks each partition's client to evaluate it and
    reports the example-weighted mean, as Flower's federated evaluation does.
    """

    def __init__(
        self,
        num_partitions: int,
        run_config: Mapping[str, Any] | None = None,
        app_config: str = "",
        evaluate: bool = False,
    ) -> None:
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
            raise ConfigError(f"task_options.num_partitions = {num_partitions!r} should be an int")
        if num_partitions < 1:
            raise ConfigError(f"num_partitions must be >= 1, got {num_partitions}")
        self.num_partitions = num_partitions
        self.run_config = load_run_config(app_config, run_config)
        self.federated_evaluation = evaluate
        #: Per-process caches (Contexts; subclasses add clients, the app), rebuilt where
        #: the task is unpickled: simulation workers get references and options only.
        self._contexts: dict[int, Any] = {}
        #: node_config of the partition a deployment site holds (`site_data`).
        self._node_configs: dict[int, dict[str, Any]] = {}
        self._home = 0  # the partition whose client provides `model()`

    _caches: tuple[str, ...] = ("_contexts",)

    def __getstate__(self) -> dict[str, Any]:
        return {k: ({} if k in self._caches else v) for k, v in self.__dict__.items()}

    def context(self, partition_id: int) -> Any:
        """The Flower `Context` of one partition, built once (its `state` persists)."""
        if partition_id not in self._contexts:
            from flwr.app import Context, RecordDict

            node_config = {
                "partition-id": partition_id,
                "num-partitions": self.num_partitions,
                **self._node_configs.get(partition_id, {}),
            }
            self._contexts[partition_id] = Context(
                run_id=0,
                node_id=partition_id,
                node_config=node_config,
                state=RecordDict(),
                run_config=self.run_config,
            )
        return self._contexts[partition_id]

    def datasets(self) -> tuple[Dataset, Dataset | None]:
        ids = PartitionIds(self.num_partitions)
        return ids, (ids if self.federated_evaluation else None)

    def site_data(self, site_name: str, **node_config: Any) -> Dataset:
        """A deployment site's data: the one partition its node_config names (see the
        module docstring); the client's Context gets that node_config."""
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
    def _partitions(data: Dataset) -> list[int]:
        return [int(data[i]) for i in range(len(data))]  # type: ignore[arg-type]

    @staticmethod
    def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }


def mean_eval(results: list[EvalResult]) -> EvalResult:
    """Example-weighted mean of several partitions' evaluations (Flower's federated
    evaluation aggregate)."""
    n = sum(r.num_examples for r in results)
    if n == 0:
        return EvalResult(0, float("nan"))
    loss = sum(r.num_examples * r.loss for r in results) / n
    metrics = weighted_metrics([(r.num_examples, r.metrics) for r in results])
    return EvalResult(n, loss, metrics)


class FlowerTask(FlowerPartitions):
    """A Flower NumPyClient factory as a fedtrain Task (see the module docstring)."""

    _caches = ("_contexts", "_clients")

    def __init__(
        self,
        client_fn: str | Callable[..., Any],
        num_partitions: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        model: str | Callable[[], Any] | None = None,
        app_config: str = "",
        evaluate: bool = False,
        parameter_names: list[str] | str | None = None,
    ) -> None:
        super().__init__(num_partitions, run_config, app_config, evaluate)
        self.parameter_names = parameter_names
        self.client_fn = (
            client_fn
            if callable(client_fn)
            else import_reference(client_fn, "task_options.client_fn", "function")
        )
        self.module_factory = None if model is None else ModuleFactory(model, "task_options.model")
        ref = client_fn if isinstance(client_fn, str) else self.client_fn.__qualname__
        self.version = f"flower:{ref}"  # part of the fingerprint sites must share
        self._clients: dict[int, Any] = {}

    def client(self, partition_id: int) -> Any:
        """The NumPyClient of one partition, built once and kept (clients may be stateful)."""
        if partition_id not in self._clients:
            self._clients[partition_id] = self._build(partition_id)
        return self._clients[partition_id]

    def _build(self, partition_id: int) -> Any:
        params = list(inspect.signature(self.client_fn).parameters)
        if params and params[0] in ("context", "ctx"):
            client = self.client_fn(self.context(partition_id))
        else:
            client = self.client_fn(str(partition_id))
        client = getattr(client, "numpy_client", client)  # `.to_client()` wraps it
        for method in ("get_parameters", "fit", "evaluate"):
            if not callable(getattr(client, method, None)):
                raise TaskError(f"client_fn returned {type(client).__name__}, not a NumPyClient")
        return client

    def site_data(self, site_name: str, **node_config: Any) -> SiteData:  # type: ignore[override]
        """The partition, for training and as the held-out set: the client's own
        `evaluate()` reads its test data, so the site answers federated evaluation."""
        part = super().site_data(site_name, **node_config)
        return SiteData(part, part)

    def client_test_data(self, data: Dataset) -> Dataset | None:
        """A simulated client evaluates through its own `evaluate()` (its own test data)."""
        return data

    def export_names(self) -> Mapping[str, str]:
        """p0, p1, ... -> `parameter_names` (see the module docstring)."""
        names = self.parameter_names
        if names is None or self.module_factory is not None:
            return {}
        if isinstance(names, str):
            names = import_reference(names, "task_options.parameter_names", "function")()
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"parameter_names must be a list of names or 'module:function' returning one, "
                f"got {names!r}"
            )
        return {f"p{i}": name for i, name in enumerate(names)}

    def model(self) -> nn.Module:
        if self.module_factory is not None:
            return self.module_factory()
        return ArrayModule(self.client(self._home).get_parameters({}))

    def train(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> TrainResult:
        arrays, num_examples, metrics = self.client(self._partition(data)).fit(
            get_arrays(model), RoundConfigDict(config)
        )
        set_arrays(model, arrays)
        return TrainResult(int(num_examples), self._numeric(metrics))

    def evaluate(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> EvalResult:
        results = []
        for partition_id in self._partitions(data):
            loss, num_examples, metrics = self.client(partition_id).evaluate(
                get_arrays(model), RoundConfigDict(config)
            )
            results.append(EvalResult(int(num_examples), float(loss), self._numeric(metrics)))
        return mean_eval(results)


def get_arrays(model: nn.Module) -> list[np.ndarray]:
    """The arrays a NumPyClient exchanges: the model's state_dict values, in order."""
    return [t.detach().cpu().numpy() for t in model.state_dict().values()]


def set_arrays(model: nn.Module, arrays: list[np.ndarray]) -> None:
    """Load a NumPyClient's returned arrays back, by position, checking each one."""
    state = model.state_dict()
    if len(arrays) != len(state):
        raise TaskError(
            f"Flower client returned {len(arrays)} arrays, but the model has {len(state)} "
            f"tensors ({list(state)}); a NumPyClient must return every array it was given, "
            "in order (with task_options.model: every state_dict entry)"
        )
    with torch.no_grad():
        for (name, t), a in zip(state.items(), arrays, strict=True):
            new = torch.from_numpy(np.asarray(a))
            if new.shape != t.shape or new.dtype != t.dtype:
                raise TaskError(
                    f"Flower client returned {name!r} as {new.dtype} {tuple(new.shape)}, "
                    f"expected {t.dtype} {tuple(t.shape)}"
                )
            t.copy_(new)
