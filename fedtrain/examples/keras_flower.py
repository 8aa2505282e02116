"""A Keras model trained through Flower's NumPyClient interop (`fedtrain.compat.flower`).

This is what a TensorFlow/Keras user already has: a Flower `NumPyClient` around a
compiled Keras model (`get_weights`/`set_weights`, `model.fit`, `model.evaluate`).
fedtrain runs it unchanged, in a simulation and at the sites of a deployment, with
the same config lines as any Flower client:

    task = "fedtrain.compat.flower:FlowerTask"
    [task_options]
    client_fn = "fedtrain.examples.keras_flower:client_fn"
    num_partitions = 2
    parameter_names = "fedtrain.examples.keras_flower:parameter_names"

The weights travel as fedtrain tensors (FedAvg, secure aggregation, checkpoints all
apply) and the exported `model.safetensors` carries Keras' own weight names
(`mlp/hidden/kernel`, ...). Data: the breast-cancer table, split IID into
`num-partitions` parts, each client evaluating on the shared held-out quarter.

Needs TensorFlow (`pip install 'fedtrain[keras]'`, or `tensorflow-cpu`); Keras 3 runs
on the backend `KERAS_BACKEND` names, TensorFlow unless set. Recorded runs:
`simulations/RESULTS.md` ("Keras through the Flower interop").
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fedtrain.examples.breast_cancer import BreastCancerTask
from fedtrain.partition import iid

SEED = 0
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter


def build_model(features: int = 30, classes: int = 2, lr: float = 0.1) -> Any:
    """A small MLP, compiled: logits + sparse cross-entropy, SGD."""
    import keras

    keras.utils.set_random_seed(SEED)  # the same initial weights in every process
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(classes, name="logits"),
        ],
        name="mlp",  # weight names (mlp/hidden/kernel, ...) the same in every process
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def parameter_names() -> list[str]:
    """Keras' names of the weights, in `get_weights()` order (for exported files)."""
    return [w.path for w in build_model().weights]


def _numpy_client_base() -> type:
    from flwr.client import NumPyClient

    return NumPyClient


class KerasClient(_numpy_client_base()):  # type: ignore[misc]
    """The Flower client a Keras user writes: nothing fedtrain-specific in it."""

    def __init__(self, partition_id: int, num_partitions: int) -> None:
        train, test = BreastCancerTask().datasets()
        part = iid(len(train), num_partitions, SEED)[partition_id]
        self.x, self.y = train.tensors[0][part].numpy(), train.tensors[1][part].numpy()
        self.x_test, self.y_test = test.tensors[0].numpy(), test.tensors[1].numpy()
        self.model = build_model()

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return self.model.get_weights()

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, float]]:
        self.model.set_weights(parameters)
        self.model.optimizer.learning_rate.assign(float(config.get("lr", 0.1)))
        history = self.model.fit(
            self.x,
            self.y,
            epochs=int(config.get("epochs", 1)),
            batch_size=int(config.get("batch_size", 32)),
            shuffle=True,
            verbose=0,
        )
        return self.model.get_weights(), len(self.y), {"train_loss": history.history["loss"][-1]}

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, float]]:
        self.model.set_weights(parameters)
        loss, accuracy = self.model.evaluate(self.x_test, self.y_test, verbose=0)
        return float(loss), len(self.y_test), {"accuracy": float(accuracy)}


def client_fn(context: Any) -> Any:
    """Flower's ClientApp entry point: one client per partition of the node config."""
    node = context.node_config
    return KerasClient(int(node["partition-id"]), int(node["num-partitions"])).to_client()
