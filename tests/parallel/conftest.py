"""Spawned workers import the test tasks by name: put this folder on sys.path
(spawn passes the parent's sys.path to its children)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
