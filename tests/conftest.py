"""Session-wide: every process the tests start is stopped when the session ends or is
interrupted (`process_sweep`), and the header says how long the run takes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for folder in (str(HERE), str(HERE.parent)):  # process_sweep; the benchmarks it uses
    if folder not in sys.path:
        sys.path.insert(0, folder)

from process_sweep import pytest_configure, pytest_unconfigure  # noqa: E402  (hooks)

__all__ = ["pytest_configure", "pytest_report_header", "pytest_unconfigure"]


def pytest_report_header(config: Any) -> str:
    return (
        "tests marked `integration` start real servers and sites and take most of the "
        "run (timings: README, 'Tests'); -m 'not integration' runs the rest"
    )
