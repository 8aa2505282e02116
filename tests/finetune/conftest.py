"""Fine-tuning tests: transformers and peft must never reach for the hub."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported; children inherit it
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import sys
from pathlib import Path

RUNTIME = str(Path(__file__).resolve().parents[1] / "runtime")  # runtime_support
if RUNTIME not in sys.path:
    sys.path.insert(0, RUNTIME)
