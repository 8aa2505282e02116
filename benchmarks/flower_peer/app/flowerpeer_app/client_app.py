"""ClientApp: a deliberately trivial "training" step.

The benchmark measures runtime overhead (transport, serialization, process model),
not learning, so the client does one elementwise op over the flat parameter vector:
``w + delta``. fedtrain's side of the comparison must do the same op (one float32
add over P elements, returning the array and ``num_examples``) so compute is equal.

With run-config ``client-torch = true`` the add is done through ``torch`` instead,
which makes every per-message ``flwr-clientapp`` process import torch, as a real
PyTorch ClientApp does. That import (seconds, hundreds of MB) is a cost of Flower's
process-per-message model, so benchmarks should report both variants.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Add ``delta`` to every parameter and return it with a fixed example count."""
    delta = np.float32(context.run_config["delta"])
    if bool(context.run_config["incompressible"]):
        # a different delta per site, so no two updates share a chunk (Flower
        # content-addresses chunks and sends each distinct one once)
        delta = np.float32(delta * (1.0 + int(context.node_config["partition-id"]) / 16))
    num_examples = int(context.run_config["num-examples"])
    (weights,) = msg.content["arrays"].to_numpy_ndarrays(keep_input=False)
    # np.load() output is writable; add in place so no second P-sized copy is made.
    if bool(context.run_config["client-torch"]):
        import torch  # only the torch variant should pay for this import

        torch.from_numpy(weights).add_(float(delta))
    else:
        np.add(weights, delta, out=weights)
    reply = RecordDict(
        {
            "arrays": ArrayRecord([weights], keep_input=False),
            "metrics": MetricRecord({"num-examples": num_examples}),
        }
    )
    return Message(content=reply, reply_to=msg)
