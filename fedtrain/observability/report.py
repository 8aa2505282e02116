"""`fedtrain report RUN_DIR`: PNG plots and a one-page HTML summary of a run.

Reads only what every run writes (`metrics.jsonl`, `config.json`) plus the runtime's
`audit.jsonl` when present, so it works for simulations and deployments alike.
Plots: accuracy and loss per round (on the server's test set, or the federation's
example-weighted mean when the sites evaluated; with personalization, the sites'
fine-tuned copies beside the global model, dashed), each site's own accuracy per
round (federated evaluation: which site lags, and since when), bytes per round, per-site
participation (from the audit log), privacy epsilon when DP was on, and the
cross-site validation's heat-map (`cross_site.json`) when the run made one.

Fast to start: neither torch (a report reads JSON) nor pyplot (figures are drawn
with matplotlib's object API straight to the Agg canvas, so no GUI backend is looked
for) is imported; on a busy machine each cost more seconds than drawing the plots.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedtrain.errors import ConfigError
from fedtrain.files import read_jsonl
from fedtrain.round_record import site_count, upgrade

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
AUDIT = "audit.jsonl"
CROSS_SITE_FILE = "cross_site.json"  # fedtrain.evaluation's, which imports torch


def _series(metrics: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(m["round"], m[key]) for m in metrics if m.get(key) is not None]
    return [r for r, _ in rows], [float(v) for _, v in rows]


@contextmanager
def _round_figure(out: Path, title: str, height: float = 3.5) -> Iterator[Any]:
    """An axes with rounds on x; titled, laid out and saved to `out` on exit."""
    log.info("plotting %s", out.name)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, height), dpi=110)
    FigureCanvasAgg(fig)  # files only: never looks for a display
    ax = fig.subplots()
    yield ax
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)


def plot_accuracy(metrics: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """The global model's accuracy and loss per evaluated round; with personalization,
    the fine-tuned copies' too (dashed)."""
    rounds_acc, acc = _series(metrics, "accuracy")
    rounds_loss, loss = _series(metrics, "loss")
    if not acc and not loss:
        return None
    federated = any(m.get("eval_source") == "sites" for m in metrics)
    title = "Global model at the sites (federated)" if federated else "Global model on the test set"
    personal_acc = _series(metrics, "personalized_accuracy")
    personal_loss = _series(metrics, "personalized_loss")
    if personal_acc[1] or personal_loss[1]:
        title += ", and fine-tuned at each site"
    with _round_figure(out, title, height=4) as ax:
        lines = []
        if acc:
            lines += ax.plot(rounds_acc, acc, marker="o", color="tab:blue", label="test accuracy")
            ax.set_ylabel("accuracy", color="tab:blue")
            ax.set_ylim(0, 1.02)
        if personal_acc[1]:
            lines += ax.plot(
                *personal_acc, "--", marker="o", color="tab:blue", label="personalized accuracy"
            )
        if loss:
            ax2 = ax.twinx()
            lines += ax2.plot(rounds_loss, loss, marker="s", color="tab:orange", label="test loss")
            ax2.set_ylabel("loss", color="tab:orange")
            if personal_loss[1]:
                lines += ax2.plot(
                    *personal_loss, "--", marker="s", color="tab:orange", label="personalized loss"
                )
        if personal_acc[1] or personal_loss[1]:
            ax.legend(handles=lines, fontsize="small", loc="center right")
        ax.grid(alpha=0.3)
    return out


def plot_site_accuracy(metrics: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Each site's accuracy per evaluated round, beside the federation's mean."""
    sites = sorted({s for m in metrics for s in (m.get("site_metrics") or {})})
    if not sites:
        return None
    personalized = any(m.get("personalized_accuracy") is not None for m in metrics)
    title = "Accuracy at each site" + (" (dashed: personalized)" if personalized else "")
    with _round_figure(out, title, height=4) as ax:
        for site in sites:
            (line,) = ax.plot(
                *_site_series(metrics, site, "accuracy"), marker=".", alpha=0.8, label=site
            )
            mine = _site_series(metrics, site, "personalized_accuracy")
            if mine[0]:
                ax.plot(*mine, "--", marker=".", alpha=0.8, color=line.get_color())
        rounds, acc = _series(metrics, "accuracy")
        ax.plot(rounds, acc, color="black", linewidth=2.5, label="federation (weighted mean)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(sites) <= 12:
            ax.legend(fontsize="small", loc="lower right")
    return out


def _site_series(
    metrics: Sequence[dict[str, Any]], site: str, key: str
) -> tuple[list[int], list[float]]:
    """One site's `key` per round, where it has one."""
    rows = [(m["round"], (m.get("site_metrics") or {}).get(site, {}).get(key)) for m in metrics]
    return [r for r, v in rows if v is not None], [float(v) for _, v in rows if v is not None]


#: (upload, download) keys of a metrics record: the simulation's, then the server's
#: (whose `bytes_in` are the sites' uploads).
_DIRECTIONS = (("bytes_up", "bytes_down"), ("bytes_in", "bytes_out"))


def plot_bytes(metrics: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Bytes per round, split into uploads and downloads where the run recorded both,
    so that a codec's smaller uploads show next to the unchanged downloads."""
    rounds, values = _series(metrics, "bytes")
    if not values:
        return None
    with _round_figure(out, "Bytes on the wire per round") as ax:
        for up_key, down_key in _DIRECTIONS:
            up, down = _series(metrics, up_key), _series(metrics, down_key)
            if up[0] == rounds and down[0] == rounds:
                mib_up = [v / 2**20 for v in up[1]]
                mib_down = [v / 2**20 for v in down[1]]
                ax.bar(rounds, mib_up, color="tab:purple", label="updates up")
                ax.bar(rounds, mib_down, bottom=mib_up, color="tab:green", label="model down")
                ax.set_ylim(0, 1.2 * max(u + d for u, d in zip(mib_up, mib_down, strict=True)))
                ax.legend(loc="upper right", ncol=2, fontsize="small")
                break
        else:
            ax.bar(rounds, [v / 2**20 for v in values], color="tab:green")
        ax.set_ylabel("MiB")
        ax.grid(axis="y", alpha=0.3)
    return out


def plot_epsilon(metrics: Sequence[dict[str, Any]], out: Path) -> Path | None:
    rounds, eps = _series(metrics, "epsilon")
    if not eps:
        return None
    delta = next((m["delta"] for m in metrics if m.get("delta") is not None), None)
    title = f"Privacy spent (delta = {delta:g})" if delta else "Privacy spent"
    with _round_figure(out, title) as ax:
        ax.plot(rounds, eps, marker="o", color="tab:red")
        ax.set_ylabel("epsilon")
        ax.grid(alpha=0.3)
    return out


def participation(audit: Sequence[dict[str, Any]]) -> dict[str, dict[int, str]]:
    """site -> round -> 'trained' | 'dropped' | 'failed', from round_completed records."""
    table: dict[str, dict[int, str]] = {}
    for rec in audit:
        if rec.get("event") != "round_completed":
            continue
        for status in ("trained", "dropped", "failed"):
            key = "contributors" if status == "trained" else status
            for site in rec.get(key) or []:
                table.setdefault(site, {})[int(rec["round"])] = status
    return table


def plot_participation(audit: Sequence[dict[str, Any]], out: Path) -> Path | None:
    table = participation(audit)
    if not table:
        return None
    from matplotlib.colors import ListedColormap

    sites = sorted(table)
    last = max(r for rounds in table.values() for r in rounds)
    codes = {"absent": 0, "trained": 1, "dropped": 2, "failed": 3}
    grid = [[codes[table[s].get(r, "absent")] for r in range(1, last + 1)] for s in sites]
    cmap = ListedColormap(["#eeeeee", "tab:green", "tab:orange", "tab:red"])
    title = "Participation: green trained, orange dropped, red failed, grey absent"
    with _round_figure(out, title, height=1.2 + 0.35 * len(sites)) as ax:
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
        ax.set_yticks(range(len(sites)), sites)
        ax.set_xticks(range(last), [str(r) for r in range(1, last + 1)])
    return out


def plot_cross_site(matrix: dict[str, Any], out: Path) -> Path | None:
    """The cross-site validation (`cross_site.json`) as a heat-map: a row per model
    evaluated, a column per site, each cell its accuracy (its loss when the task
    reports none), written in the cell; sites that did not answer are left blank."""
    models = matrix.get("models") or {}
    sites = sorted({s for row in models.values() for s in (*row["sites"], *row["missing"])})
    if not models or not sites:
        return None
    names = list(models)
    key = "accuracy"
    if not all("accuracy" in m for row in models.values() for m in row["sites"].values()):
        key = "loss"
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    log.info("plotting %s", out.name)
    values = np.full((len(names), len(sites)), np.nan)
    for i, name in enumerate(names):
        for j, site in enumerate(sites):
            cell = models[name]["sites"].get(site)
            if cell is not None:
                values[i, j] = cell[key]
    fig = Figure(figsize=(max(5.0, 1.0 + 0.9 * len(sites)), 1.6 + 0.6 * len(names)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    cmap = "RdYlGn" if key == "accuracy" else "RdYlGn_r"
    limits = {"vmin": 0.0, "vmax": 1.0} if key == "accuracy" else {}
    image = ax.imshow(values, cmap=cmap, aspect="auto", **limits)
    for i in range(len(names)):
        for j in range(len(sites)):
            text = "no answer" if np.isnan(values[i, j]) else f"{values[i, j]:.3f}"
            ax.text(j, i, text, ha="center", va="center", fontsize="small")
    ax.set_xticks(range(len(sites)), sites, rotation=30, ha="right")
    labels = ["global model" if n == "global" else f"{n}'s local model" for n in names]
    ax.set_yticks(range(len(names)), labels)
    ax.set_xlabel("evaluated at site (on its held-out data)")
    ax.set_title(f"Cross-site validation after round {matrix.get('round', '?')}: {key}")
    fig.colorbar(image, ax=ax, label=key)
    fig.tight_layout()
    fig.savefig(out)
    return out


def write_report(run_path: str | Path) -> Path:
    """Write `report/` inside the run directory; returns the HTML file's path."""
    run = Path(run_path)
    if not run.is_dir():
        raise ConfigError(f"{run_path} is not a run directory")
    metrics = [upgrade(m) for m in read_jsonl(run / METRICS).records]  # any record's age
    if not metrics:
        raise ConfigError(
            f"{run / METRICS} is missing or empty: is {run} a fedtrain run directory?"
        )
    audit = read_jsonl(run / AUDIT).records
    log.info(
        "%s: %d rounds in %s%s",
        run,
        len(metrics),
        METRICS,
        f", {len(audit)} records in {AUDIT}" if audit else "",
    )
    config_path = run / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    cross_path = run / CROSS_SITE_FILE
    cross_site = json.loads(cross_path.read_text()) if cross_path.exists() else None
    out = run / "report"
    out.mkdir(exist_ok=True)
    plots = [
        p
        for p in (
            plot_accuracy(metrics, out / "accuracy.png"),
            plot_site_accuracy(metrics, out / "site_accuracy.png"),
            plot_bytes(metrics, out / "bytes.png"),
            plot_participation(audit, out / "participation.png"),
            plot_epsilon(metrics, out / "epsilon.png"),
            plot_cross_site(cross_site, out / "cross_site.png") if cross_site else None,
        )
        if p is not None
    ]
    page = out / "index.html"
    page.write_text(_html(run, metrics, config, plots), encoding="utf-8")
    return page


#: The rounds table's columns (`fedtrain.round_record` says what each means).
_COLUMNS = (
    "round",
    "accuracy",
    "personalized_accuracy",
    "loss",
    "worst_accuracy",
    "selected",
    "clients",
    "dropped",
    "failed",
    "bytes",
    "bytes_up",
    "seconds",
    "epsilon",
)


def _html(
    run_path: Path, metrics: Sequence[dict[str, Any]], config: dict[str, Any], plots: list[Path]
) -> str:
    last = metrics[-1]
    accs = [m["accuracy"] for m in metrics if m.get("accuracy") is not None]
    facts = {
        "run directory": str(run_path.resolve()),
        "task": config.get("task", "?"),
        "strategy": (config.get("strategy") or {}).get("name", "?"),
        "rounds completed": last["round"],
        "final accuracy": f"{accs[-1]:.4f}" if accs else "n/a",
        "best accuracy": f"{max(accs):.4f}" if accs else "n/a",
        "total seconds": f"{sum(m.get('seconds', 0.0) for m in metrics):.1f}",
        "total bytes": f"{sum(m.get('bytes', 0) for m in metrics) / 2**20:.1f} MiB",
    }
    evaluated = [m for m in metrics if m.get("accuracy") is not None]
    if evaluated and evaluated[-1].get("eval_source") == "sites":
        final = evaluated[-1]
        how = "federated, secure" if final.get("eval_secure") else "federated"
        facts["final accuracy"] += f" ({how}: {final.get('eval_sites', '?')} sites)"
        if final.get("worst_accuracy") is not None:
            facts["worst site"] = f"{final['worst_site']}: accuracy {final['worst_accuracy']:.4f}"
            if final.get("site_spread") is not None:
                facts["worst site"] += f" (spread across sites {final['site_spread']:.4f})"
        if final.get("personalized_accuracy") is not None:
            facts["final personalized accuracy"] = (
                f"{final['personalized_accuracy']:.4f} (fine-tuned at the sites: "
                f"{final['personalized_examples']} of {final['eval_examples']} held-out examples)"
            )
    if last.get("epsilon") is not None:
        facts["privacy"] = f"epsilon {last['epsilon']:.3f} at delta {last.get('delta', '?')}"
    columns = [k for k in _COLUMNS if any(k in m for m in metrics)]
    esc = html.escape

    def cell(record: dict[str, Any], key: str) -> str:
        value = record.get(key, "")
        if key in ("dropped", "failed"):  # names today, a count in old simulation lines
            value = site_count(value)
        return f"{value:.4g}" if isinstance(value, float) else esc(str(value))

    rows = "\n".join(
        "<tr>" + "".join(f"<td>{cell(m, k)}</td>" for k in columns) + "</tr>" for m in metrics
    )
    fact_rows = "\n".join(
        f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in facts.items()
    )
    images = "\n".join(f'<img src="{esc(p.name)}" alt="{esc(p.stem)}">' for p in plots)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fedtrain run report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 900px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 3px 10px; text-align: right; }}
th {{ background: #f4f4f4; text-align: left; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
</style></head><body>
<h1>fedtrain run report</h1>
<table>{fact_rows}</table>
{images}
<h2>Rounds</h2>
<table><tr>{"".join(f"<th>{esc(k)}</th>" for k in columns)}</tr>
{rows}
</table>
</body></html>
"""
