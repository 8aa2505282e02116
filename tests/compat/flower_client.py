"""Real Flower clients (flwr 1.42 API), written as a Flower user would, for interop tests.

The NumPyClient trains the breast-cancer logistic regression with full-batch gradient
descent on partition `partition-id` of an IID split, exactly what `NativeEquivalent`
does natively. `probe_app` is a Message-API ClientApp that reports what it was sent;
`broken_app` replies without "num-examples".
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from fedtrain.examples import BreastCancerTask
from fedtrain.partition import iid

SEED = 0


class BreastCancerClient(NumPyClient):
    def __init__(self, partition_id: int, num_partitions: int) -> None:
        train, _ = BreastCancerTask().datasets()
        part = iid(len(train), num_partitions, SEED)[partition_id]
        self.x, self.y = train.tensors[0][part], train.tensors[1][part]
        torch.manual_seed(SEED)
        self.model = torch.nn.Linear(30, 2)

    def get_parameters(self, config):
        return [p.detach().numpy().copy() for p in self.model.parameters()]

    def set_parameters(self, parameters):
        with torch.no_grad():
            for p, a in zip(self.model.parameters(), parameters, strict=True):
                p.copy_(torch.from_numpy(a))

    def fit(self, parameters, config):
        self.set_parameters(parameters)
        opt = torch.optim.SGD(self.model.parameters(), lr=float(config["lr"]))
        for _ in range(int(config["epochs"])):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
            opt.step()
        return self.get_parameters({}), len(self.y), {"partition": 1}

    def evaluate(self, parameters, config):
        self.set_parameters(parameters)
        with torch.no_grad():
            out = self.model(self.x)
            loss = float(torch.nn.functional.cross_entropy(out, self.y))
            acc = float((out.argmax(1) == self.y).float().mean())
        return loss, len(self.y), {"accuracy": acc}


def client_fn(context: Context):
    return BreastCancerClient(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    ).to_client()


def legacy_client_fn(cid: str):
    return BreastCancerClient(int(cid), 4)


class NativeEquivalent(BreastCancerTask):
    """The same training as a native fedtrain task: one full batch per epoch."""

    def model(self):
        torch.manual_seed(SEED)
        return torch.nn.Linear(30, 2)


def native_arrays(state) -> list[np.ndarray]:
    return [state["weight"].numpy(), state["bias"].numpy()]


def linear_model() -> torch.nn.Module:
    """The client's model, named: what `task_options.model` builds."""
    torch.manual_seed(SEED)
    return torch.nn.Linear(30, 2)


# -- a Message-API ClientApp that reports what it was sent ------------------------------
probe_app = ClientApp()


@probe_app.train()
def probe_train(msg: Message, context: Context) -> Message:
    """Returns the model unchanged and, as metrics, what the message and context held."""
    calls = context.state.get("probe", ConfigRecord({"calls": 0}))
    calls["calls"] = int(calls["calls"]) + 1
    context.state["probe"] = calls  # Context.state persists across rounds, per node
    config = msg.content["config"]
    metrics = {
        "num-examples": 10 + int(context.node_config["partition-id"]),
        "lr_seen": float(config["lr"]),
        "server_round": int(config["server-round"]),
        "calls": int(calls["calls"]),
        "batch_seen": int(context.run_config["batch-size"]),
    }
    content = RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


broken_app = ClientApp()


@broken_app.train()
def broken_train(msg: Message, context: Context) -> Message:
    """Replies without the number of examples its update is worth."""
    content = RecordDict(
        {"arrays": msg.content["arrays"], "metrics": MetricRecord({"train_loss": 1.0})}
    )
    return Message(content=content, reply_to=msg)
