"""Docs that cannot drift: the README's config and metrics tables are generated from the code."""

from __future__ import annotations

from pathlib import Path

from fedtrain.docgen import TABLES, render

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_config_reference_matches_the_code():
    text = README.read_text()
    assert render(text) == text, "README tables are stale: run `python -m fedtrain.docgen`"
    for name in TABLES:
        assert f"<!-- reference:{name}:start -->" in text


def test_readme_quickstart_is_two_commands_and_ci_runs_the_same_tests():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    commands = quick.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in commands] == ["make demo", "make test"]
    assert "fedtrain demo" in quick and "python -m pytest" in quick  # still work as they are
    makefile = (ROOT / "Makefile").read_text()
    assert "demo: install\n\t$(PYTHON) -m fedtrain.cli demo\n" in makefile
    assert "test:\n\t$(PYTHON) -m pytest\n" in makefile
    install = makefile.split("install:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert install == [  # torch's pinned CPU build first, then the project with its extras
        "\t$(PYTHON) -m pip install --quiet $(TORCH)",
        '\t$(PYTHON) -m pip install --quiet -e ".[dev]"',
    ]
    assert "TORCH ?= torch==2.13.0" in makefile
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line[:1] not in "#"]
    assert [line for line in ci if line.startswith("make")] == ["make install", "make test"]
