"""Makes runtime_support importable here and in the processes the tests start; `stop_after`."""

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
def pki(tmp_path: Path) -> Any:
    """A federation CA, a server certificate and site hospital-a's (runtime_support.Pki)."""
    from runtime_support import make_pki

    return make_pki(tmp_path)


@pytest.fixture
def stop_after() -> Iterator[list[Any]]:
    """Things a test started in this process (servers, sites, daemons): stopped at the end."""
    owned: list[Any] = []
    yield owned
    for thing in reversed(owned):
        thing.stop() if hasattr(thing, "stop") else thing.close()
