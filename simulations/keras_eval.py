"""Load a run's exported `model.safetensors` into the Keras model by weight name and
evaluate it on the breast-cancer held-out quarter (the Keras example's test set).

    python simulations/keras_eval.py RUN_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def evaluate(run_dir: Path) -> float:
    from safetensors.numpy import load_file

    from fedtrain.examples import BreastCancerTask
    from fedtrain.examples.keras_flower import build_model

    tensors = load_file(run_dir / "model.safetensors")
    model = build_model()
    for weight in model.weights:  # by name: the export carries Keras' own names
        weight.assign(tensors[weight.path])
    x, y = BreastCancerTask().datasets()[1].tensors
    _, accuracy = model.evaluate(x.numpy(), y.numpy(), verbose=0)
    return float(accuracy)


if __name__ == "__main__":
    print(f"accuracy of the exported Keras model: {evaluate(Path(sys.argv[1])):.4f}")
