"""Keep the README's reference tables generated from the code.

    python -m fedtrain.docgen            # rewrite README.md's reference tables in place

The config tables come from the config dataclasses, the Prometheus table from
`fedtrain.observability.metrics.METRICS`, the metrics record's from
`fedtrain.round_record.FIELDS`. Each table sits between
`<!-- reference:NAME:start -->` and `<!-- reference:NAME:end -->`; a test fails when a
table differs from what the code says.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from fedtrain.config import reference

# marker name -> "module:ConfigClass"
SECTIONS: dict[str, str] = {
    "sim": "fedtrain.simulation.config:SimConfig",
    "server": "fedtrain.runtime.config:ServerConfig",
    "site": "fedtrain.runtime.config:SiteConfig",
}

HEADER = ["| key | type | default | meaning |", "|---|---|---|---|"]
#: Every generated table's marker name: the config sections, then the metrics.
TABLES = (*SECTIONS, "metrics", "round-record")


def metrics_table() -> str:
    from fedtrain.observability.metrics import METRICS

    rows = [f"| `{name}` | {meaning} |" for name, meaning in METRICS.items()]
    return "\n".join(["| metric | meaning |", "|---|---|", *rows])


def table(name: str) -> str:
    if name == "metrics":
        return metrics_table()
    if name == "round-record":
        from fedtrain.round_record import readme_table

        return readme_table()
    module, _, cls = SECTIONS[name].partition(":")
    return "\n".join(HEADER + reference(getattr(importlib.import_module(module), cls)))


def render(text: str) -> str:
    """`text` with every reference table regenerated."""
    for name in TABLES:
        pattern = re.compile(
            rf"(<!-- reference:{name}:start -->\n).*?(<!-- reference:{name}:end -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(f"README has no reference:{name} markers")
        text = pattern.sub(lambda m, n=name: m.group(1) + table(n) + "\n" + m.group(2), text)
    return text


def main(path: str = "README.md") -> None:
    readme = Path(path)
    readme.write_text(render(readme.read_text()))


if __name__ == "__main__":
    main(*sys.argv[1:])
