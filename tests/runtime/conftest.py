"""Makes runtime_support importable here and in the processes the tests start."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def stop_after() -> Iterator[list[Any]]:
    """Servers, sites and daemons the test appends here are stopped after it, last first."""
    owned: list[Any] = []
    yield owned
    for thing in reversed(owned):
        thing.stop() if hasattr(thing, "stop") else thing.close()
