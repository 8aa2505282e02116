"""Docs that cannot drift: the README's config and metrics tables are generated from the code."""

from __future__ import annotations

from pathlib import Path

from fedtrain.docgen import TABLES, render

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_matches_the_code():
    text = README.read_text()
    assert render(text) == text, "README tables are stale: run `python -m fedtrain.docgen`"
    for name in TABLES:
        assert f"<!-- reference:{name}:start -->" in text


def test_readme_quickstart_has_the_two_commands():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert "fedtrain demo" in quick and "python -m pytest" in quick
