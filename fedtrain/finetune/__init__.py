"""Fine-tuning foundation models: LoRA adapters on the wire, the base at the site.

Needs the `hf` extra (`pip install "fedtrain[hf]"`: transformers and peft). Importing
this package imports neither; the task classes do when they build a model.
"""

from fedtrain.finetune.causal_lm import GeneratedReportsTask, TransformersTask

__all__ = ["GeneratedReportsTask", "TransformersTask"]
