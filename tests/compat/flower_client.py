"""A real Flower NumPyClient (flwr 1.42 API), written as a Flower user would, for interop tests.

It trains the breast-cancer logistic regression with full-batch gradient descent on
partition `partition-id` of an IID split, exactly what `NativeEquivalent` does natively.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Context

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
