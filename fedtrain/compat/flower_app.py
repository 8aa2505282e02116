"""Run a Flower Message-API `ClientApp`, unchanged, as a fedtrain task.

Flower's current quickstarts are a `ClientApp` with `@app.train()` and
`@app.evaluate()` functions that take `(msg: Message, context: Context)` and reply
with a `Message`. This task delivers those messages the way a SuperNode does:

- a train message carries `RecordDict({"arrays": ArrayRecord, "config": ConfigRecord})`:
  the global model as a named state dict and the round's config (fedtrain's round
  config from `[client]` / `[client_schedule]` / the strategy's `round_config`, plus
  "server-round", as Flower's strategies add it);
- the reply must carry exactly one `ArrayRecord` (the trained state dict, same
  names) and one `MetricRecord` holding `weighted_by_key` ("num-examples"), whose
  other numbers become the round's training metrics;
- evaluate messages carry the same content and the reply's `MetricRecord` gives the
  loss and accuracy (`eval_keys`, Flower's quickstart names by default).

The model is the app's own torch module (`model`, e.g. its `Net`), so tensor names
travel, aggregate and land in `model.pt` exactly as in the module's state_dict.

    task = "fedtrain.compat.flower_app:FlowerClientApp"
    [task_options]
    clientapp = "myapp.client_app:app"     # [tool.flwr.app.components] clientapp
    model = "myapp.task:Net"               # what the ServerApp's initial arrays come from
    num_partitions = 10
    app_config = "myapp/pyproject.toml"    # optional: its [tool.flwr.app.config]
    [task_options.run_config]              # Context.run_config (overrides app_config)
    local-epochs = 1

Partitions, `node_config` and deployment sites work as for `FlowerTask` (see
`fedtrain.compat.flower`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.app.metadata import Metadata
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import Dataset

from fedtrain.compat.flower import (
    FlowerPartitions,
    MissingKey,
    ModuleFactory,
    mean_eval,
    missing_round_config,
)
from fedtrain.errors import ConfigError, TaskError
from fedtrain.references import import_reference
from fedtrain.task import EvalResult, TaskContext, TrainResult

#: Flower's id of the SuperLink, the sender of every instruction a ClientApp gets.
SUPERLINK_NODE_ID = 1
#: Flower's default time-to-live of a message (12 hours).
DEFAULT_TTL_S = 43200.0


class RoundConfigRecord(ConfigRecord):
    """The round's config record; a missing key names `[client]`, not a bare KeyError."""

    def __getitem__(self, key: str) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            raise MissingKey(missing_round_config(key, self)) from None


class FlowerClientApp(FlowerPartitions):
    """A Flower Message-API `ClientApp` as a fedtrain Task (see the module docstring)."""

    def __init__(
        self,
        clientapp: str | Any,
        model: str | Callable[[], Any],
        num_partitions: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        app_config: str = "",
        evaluate: bool = False,
        weighted_by_key: str = "num-examples",
        eval_keys: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(num_partitions, run_config, app_config, evaluate)
        self.clientapp = clientapp
        self._app: dict[str, ClientApp] = {}
        self.app  # noqa: B018 (a bad reference fails when the config is read)
        self.build_model = ModuleFactory(model, "task_options.model")
        self.weighted_by_key = weighted_by_key
        self.eval_keys = {"loss": "eval_loss", "accuracy": "eval_acc", **(eval_keys or {})}
        ref = clientapp if isinstance(clientapp, str) else type(clientapp).__qualname__
        self.version = f"flower-app:{ref}"  # part of the fingerprint sites must share

    _caches = ("_contexts", "_app")

    @property
    def app(self) -> ClientApp:
        """The ClientApp `clientapp` names, imported once per process."""
        if "app" not in self._app:
            app = self.clientapp
            if isinstance(app, str):
                app = import_reference(app, "task_options.clientapp", "app")
            if not isinstance(app, ClientApp):
                raise ConfigError(
                    f"task_options.clientapp = {self.clientapp!r} is a {type(app).__name__}, "
                    "not a flwr.clientapp.ClientApp (name the `app = ClientApp()` object)"
                )
            self._app["app"] = app
        return self._app["app"]

    def model(self) -> nn.Module:
        return self.build_model()

    def train(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> TrainResult:
        partition_id = self._partition(data)
        content = self._send("train", partition_id, model, config)
        arrays = list(content.array_records.values())
        if len(arrays) != 1 or not isinstance(arrays[0], ArrayRecord):
            raise TaskError(
                f"partition {partition_id}: the ClientApp's train reply holds "
                f"{len(arrays)} ArrayRecords; it must hold exactly one, the trained model"
            )
        state = arrays[0].to_torch_state_dict()
        if differ := sorted(set(state) ^ set(model.state_dict())):
            raise TaskError(
                f"partition {partition_id}: the ClientApp's arrays and task_options.model's "
                f"state_dict differ in {differ}; it must reply with the model it was sent"
            )
        model.load_state_dict(state)
        num_examples, metrics = self._metrics(content, partition_id, "train")
        return TrainResult(num_examples, metrics)

    def evaluate(
        self, model: nn.Module, data: Dataset, config: dict[str, Any], context: TaskContext
    ) -> EvalResult:
        results = []
        for partition_id in self._partitions(data):
            content = self._send("evaluate", partition_id, model, config)
            num_examples, metrics = self._metrics(content, partition_id, "evaluate")
            loss_key = self.eval_keys["loss"]
            if loss_key not in metrics:
                raise TaskError(
                    f"partition {partition_id}: the ClientApp's evaluate reply has no "
                    f"{loss_key!r} metric (it has {sorted(metrics)}); name its loss in "
                    'task_options.eval_keys, e.g. eval_keys = { loss = "val_loss" }'
                )
            if self.eval_keys["accuracy"] in metrics:
                metrics["accuracy"] = metrics[self.eval_keys["accuracy"]]
            results.append(EvalResult(num_examples, metrics[loss_key], metrics))
        return mean_eval(results)

    # -- messages -----------------------------------------------------------------------
    def _send(self, kind: str, partition_id: int, model: nn.Module, config: dict[str, Any]) -> Any:
        """Deliver one `kind` message to the app as partition `partition_id`; the reply's
        content (a reply carrying an error becomes a TaskError)."""
        server_round = int(config.get("round", 0))
        record = RoundConfigRecord({**config, "server-round": server_round})
        metadata = Metadata(
            run_id=0,
            message_id=uuid.uuid4().hex,
            src_node_id=SUPERLINK_NODE_ID,
            dst_node_id=partition_id,
            reply_to_message_id="",
            group_id=str(server_round),
            created_at=time.time(),
            ttl=DEFAULT_TTL_S,
            message_type=kind,
        )
        arrays = ArrayRecord(model.state_dict())
        message = Message(RecordDict({"arrays": arrays, "config": record}), metadata=metadata)
        reply = self.app(message, self.context(partition_id))
        if not isinstance(reply, Message):
            raise TaskError(
                f"partition {partition_id}: the ClientApp's {kind} function returned a "
                f"{type(reply).__name__}, not a Message"
            )
        if reply.has_error():
            raise TaskError(
                f"partition {partition_id}: the ClientApp's {kind} replied with error "
                f"{reply.error.code}: {reply.error.reason}"
            )
        return reply.content

    def _metrics(self, content: Any, partition_id: int, kind: str) -> tuple[int, dict[str, float]]:
        """(weight, numeric metrics) of a reply's one MetricRecord."""
        records = list(content.metric_records.values())
        if len(records) != 1:
            raise TaskError(
                f"partition {partition_id}: the ClientApp's {kind} reply holds {len(records)} "
                f"MetricRecords; it must hold exactly one, with {self.weighted_by_key!r}"
            )
        metrics = dict(records[0])
        weight = metrics.pop(self.weighted_by_key, None)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise TaskError(
                f"partition {partition_id}: the ClientApp's {kind} reply's MetricRecord has "
                f"{self.weighted_by_key!r} = {weight!r}; it must be the number of examples "
                "(or name another key in task_options.weighted_by_key)"
            )
        return int(weight), self._numeric(metrics)
