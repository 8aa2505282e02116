"""Record the Keras example in a real deployment: `fedtrain server` + 2 `fedtrain client`
processes on 127.0.0.1 over mutual TLS, 10 rounds, MLflow tracking on; prints the
rounds and the exported model's accuracy in Keras. Needs TensorFlow.

    PYTHONPATH=tests/runtime:simulations python simulations/keras_deployment.py /tmp/keras-dep
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import tomllib
from keras_eval import evaluate
from runtime_support import Deployment

root = Path(sys.argv[1])
cfg = tomllib.loads(Path("/work/wt-stack/simulations/keras_breast_cancer.toml").read_text())
options = {**cfg["task_options"], "num_partitions": 2}
t = time.time()
with Deployment(
    root,
    cfg["task"],
    secure=True,
    rounds=10,
    task_options=options,
    allowed_sites=["hospital-a", "hospital-b"],
    strategy={"min_fit_clients": 2, "min_available_clients": 2},
    client=cfg["client"],
    tracking={"mlflow": True},
) as dep:
    dep.start_server()
    for i, name in enumerate(("hospital-a", "hospital-b")):
        dep.start_site(
            name, task_options=options, data={"source": "task", "options": {"partition-id": i}}
        )
    assert dep.wait_server(600) == 0, dep.log("server")
    dep.close()
print("seconds", round(time.time() - t, 1))
for r in dep.metrics():
    print(r["round"], r["clients"], round(r["train_loss"], 4))
print("exported model accuracy", evaluate(dep.run_dir))
