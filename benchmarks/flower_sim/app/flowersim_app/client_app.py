"""ClientApp: one virtual client's local training, as fedtrain's workers run it."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedtrain.task import TaskContext
from flowersim_app.workload import client_data, load_flat, to_flat

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global weights, train one client's data, return weights and count."""
    cfg = context.run_config
    client = int(context.node_config["partition-id"])
    task, data = client_data(cfg, client)
    (weights,) = msg.content["arrays"].to_numpy_ndarrays()
    model = task.model()
    load_flat(model, weights)
    config = {
        "epochs": int(cfg["epochs"]),
        "batch_size": int(cfg["batch-size"]),
        "lr": float(cfg["lr"]),
        "round": int(msg.content["config"]["server-round"]),
    }
    result = task.train(model, data, config, TaskContext(client_id=f"client-{client}"))
    reply = RecordDict(
        {
            "arrays": ArrayRecord([to_flat(model)]),
            "metrics": MetricRecord({"num-examples": result.num_examples}),
        }
    )
    return Message(content=reply, reply_to=msg)
