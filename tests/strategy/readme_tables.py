"""The README's table of strategy defaults that differ from Flower 1.42, parsed for tests
(test_flower_forms.py checks fedtrain's column, test_vs_flower.py Flower's)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def flower_default_rows() -> list[list[str]]:
    """Rows of the table between the flower-defaults markers, cells stripped."""
    text = README.read_text()
    table = re.search(
        r"<!-- flower-defaults:start -->\n(.*?)<!-- flower-defaults:end -->", text, re.S
    )
    assert table, "README has no flower-defaults table"
    lines = table.group(1).strip().splitlines()[2:]  # skip the header and the rule
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def literal(cell: str) -> object:
    """The Python value a table cell states in backticks (None for prose)."""
    match = re.fullmatch(r"`([^`]+)`.*", cell)
    return eval(match.group(1), {}) if match else None
