"""One round's metrics record: the `metrics.jsonl` line every driver writes.

Four drivers make model versions: the runtime's rounds, FedBuff in a deployment, the
simulation's rounds and its asynchronous (FedBuff) loop. Each builds its record with
`RoundRecord(...).to_json()` and closes it with `finished`, so a key means the same
whoever wrote it, and `fedtrain report`, Prometheus, TensorBoard, MLflow and
`fedtrain status` read one thing. `FIELDS` states each key (type, meaning, which
drivers fill it); the README's metrics section is generated from it.

Beyond the fixed keys a record carries open families that other modules own:
evaluation (`loss`, `accuracy`, `eval_*`, `site_metrics`, `worst_*`, `site_spread`:
`fedtrain.evaluation`), bytes (`bytes*`), the strategy's `aggregate_metrics` /
`round_metrics` (`train_*`, `stale_dropped`, ...), DP (`epsilon`, `delta`) and
secure aggregation (`secagg_*`). Those are never checked here beyond being JSON.

Records written before this definition (no `record_version`) are read through
`upgrade`: there, a simulation's `clients` was the number *selected* and its
`dropped` a count; `upgrade` maps them onto today's meanings (old counts stay counts:
`site_count` reads either).

Torch-free on purpose: `fedtrain report` reads records without loading torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

#: Written in every record; records without it predate this definition (`upgrade`).
RECORD_VERSION = 2

#: The drivers: the runtime's rounds, FedBuff in a deployment, the simulation's
#: rounds, the simulation's asynchronous (FedBuff) loop.
ALL_DRIVERS = ("runtime", "FedBuff", "simulation", "async sim")


class Field(NamedTuple):
    """One fixed key of the record."""

    types: tuple[type, ...]
    type_name: str
    meaning: str
    drivers: tuple[str, ...] = ALL_DRIVERS


_NAMES = (list,)
#: Every fixed key: its JSON type, meaning and the drivers that write it.
FIELDS: dict[str, Field] = {
    "record_version": Field((int,), "int", f"Format of the record ({RECORD_VERSION})."),
    "round": Field(
        (int,), "int", "The model version this record made (FedBuff: one per full buffer)."
    ),
    "attempts": Field(
        (int,), "int", "Attempts the round took (retried when too few updates arrived); 1 else."
    ),
    "selected": Field(
        (int,),
        "int",
        "Clients asked to train for this version. Synchronous: chosen for the round "
        "(after sites skipped for slow links). FedBuff: jobs that ended while this buffer "
        "filled (counted, too stale, dropped or failed).",
    ),
    "clients": Field(
        (int,),
        "int",
        "Updates counted in this version's aggregate (`len(contributors)`), whether or "
        "not the aggregate was applied (`aggregated`).",
    ),
    "contributors": Field(
        _NAMES,
        "list[str]",
        "Names of the clients whose update counted, sorted (FedBuff: in fold order; a "
        "site that finished two jobs appears twice).",
    ),
    "dropped": Field(
        _NAMES,
        "list[str]",
        "Selected clients that never delivered: left, missed the deadline, a simulated "
        "dropout, or a secure round's stage dropout. Sorted names, never a count.",
    ),
    "failed": Field(
        _NAMES,
        "list[str]",
        "Selected clients that answered but do not count: reported an error, or their "
        "update was refused (non-finite, wrong shape, weight policy). Sorted names.",
    ),
    "skipped": Field(
        _NAMES,
        "list[str]",
        "Sites left out before the round because their measured link could not finish "
        "it before the deadline (always empty in a simulation and under FedBuff).",
    ),
    "aggregated": Field(
        (bool,),
        "bool",
        "Whether the global model changed: false when too few updates counted or a "
        "secure sum was unusable.",
    ),
    "seconds": Field(
        (Real,), "float", "Wall time of the round, from its start to after evaluation."
    ),
    "loss": Field(
        (Real, type(None)),
        "float | null",
        "The global model's loss when evaluated this round (`eval_source` says where); "
        "null when not evaluated.",
    ),
    "accuracy": Field(
        (Real, type(None)),
        "float | null",
        "The global model's accuracy when evaluated this round (federated: "
        "example-weighted mean over the sites); null when not evaluated.",
    ),
}

#: The open families of keys (see the module docstring) -> (meaning, drivers), for the
#: README.
FAMILIES: dict[str, tuple[str, str]] = {
    "eval_source, eval_examples, eval_sites, eval_missing, eval_secure, eval_<metric>": (
        "Where (`server` or `sites`) and on how many examples and sites the model was "
        "evaluated, the sites asked that did not answer, other aggregated evaluation "
        "metrics (`fedtrain.evaluation`; open to new metrics).",
        "all (federated: runtime, simulation)",
    ),
    "site_metrics, worst_site, worst_accuracy, worst_loss, site_spread": (
        "Federated evaluation, per site: each site's figures (site -> metric -> value), "
        "the worst site and its figures, the spread (best minus worst accuracy, or worst "
        "minus best loss). Absent with `site_metrics = false` and always under secure "
        "aggregation.",
        "runtime, simulation",
    ),
    "bytes, bytes_in, bytes_out, bytes_in_accepted, bytes_in_discarded, bytes_in_resent": (
        "Tensor bytes received (uploads) and sent (downloads) since the last record.",
        "runtime, FedBuff",
    ),
    "bytes, bytes_up, bytes_down": (
        "The bytes the same round would move on a wire.",
        "simulation (async sim: `bytes`)",
    ),
    "train_*, stale_dropped, staleness_*, server_lr, ...": (
        "The strategy's `aggregate_metrics` (clients' training metrics, weighted) and "
        "`round_metrics`.",
        "all",
    ),
    "epsilon, delta": ("The DP accountant after this round.", "all (with DP)"),
    "secagg_*, error": (
        "Secure aggregation's figures (sites, stage dropouts, clipping); why an unmasked "
        "sum was unusable.",
        "runtime, simulation",
    ),
    "train_seconds, clients_per_s": ("Training throughput of the round.", "simulation"),
    "client_updates, sim_time": ("Updates folded so far; the virtual clock.", "async sim"),
}


#: Evaluation's keys: only an evaluation writes them, never a measurement (a site
#: could otherwise make a round look evaluated, or name a worst site).
EVALUATION_KEYS = frozenset({"site_metrics", "worst_site", "worst_accuracy", "worst_loss"})


def _reserved(key: str) -> bool:
    return key in FIELDS or key in EVALUATION_KEYS or key.startswith(("eval_", "site_"))


def _names(names: Sequence[str]) -> list[str]:
    return sorted(str(n) for n in names)


@dataclass(frozen=True)
class RoundRecord:
    """The fixed part of a record; `measurements` carries the open families."""

    round: int
    selected: int
    contributors: Sequence[str]
    dropped: Sequence[str]
    failed: Sequence[str]
    aggregated: bool
    attempts: int = 1
    skipped: Sequence[str] = ()
    #: Keep the contributors' order (FedBuff folds in arrival order, with repeats).
    ordered: bool = False
    measurements: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def buffered(
        cls,
        version: int,
        contributors: Sequence[str],
        dropped: Sequence[str],
        failed: Sequence[str],
        measurements: Mapping[str, Any],
    ) -> RoundRecord:
        """FedBuff's record of one version (both drivers): the model always changes, the
        contributors stay in fold order, and `selected` is every job that ended while
        the buffer filled: counted, too stale (`stale_dropped`), dropped or failed."""
        stale = int(measurements.get("stale_dropped", 0))
        return cls(
            round=version,
            selected=len(contributors) + stale + len(dropped) + len(failed),
            contributors=contributors,
            ordered=True,
            dropped=dropped,
            failed=failed,
            aggregated=True,
            measurements=measurements,
        )

    def to_json(self) -> dict[str, Any]:
        """The record as a metrics line, not yet evaluated (`loss`/`accuracy` null) and
        without `seconds` (`finished` sets it)."""
        contributors = [str(c) for c in self.contributors]
        record: dict[str, Any] = {
            "record_version": RECORD_VERSION,
            "round": int(self.round),
            "attempts": int(self.attempts),
            "selected": int(self.selected),
            "clients": len(contributors),
            "contributors": contributors if self.ordered else sorted(contributors),
            "dropped": _names(self.dropped),
            "failed": _names(self.failed),
            "skipped": _names(self.skipped),
            "aggregated": bool(self.aggregated),
            "loss": None,
            "accuracy": None,
        }
        record.update((k, v) for k, v in self.measurements.items() if not _reserved(k))
        for key in sorted(k for k in self.measurements if _reserved(k)):
            renamed = _renamed(key, record, self.round)
            if renamed is not None:
                record[renamed] = self.measurements[key]
        return record


def _renamed(key: str, record: Mapping[str, Any], server_round: int) -> str | None:
    """Where a measurement named like a fixed or an evaluation key goes. The record's
    keys always win (a site chooses its metrics' names: one called `round`, `clients`
    or `worst_site` must not rewrite the record); such a measurement (e.g. a client's
    training metric called `loss`) is kept as `train_<key>`, or left out (None) when
    that is taken too."""
    renamed = f"train_{key}"
    if renamed in record:
        log.warning("round %d: measurement %r names a record key: left out", server_round, key)
        return None
    log.warning(
        "round %d: measurement %r names a key of the record; written as %r",
        server_round,
        key,
        renamed,
    )
    return renamed


def finished(record: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Close `record` (its wall time) and check it against `FIELDS`; returns it."""
    record["seconds"] = float(seconds)
    check_record(record)
    return record


def check_record(record: Mapping[str, Any]) -> None:
    """Raise ValueError naming the key and round when `record` breaks the definition."""
    where = f"metrics record of round {record.get('round', '?')}"
    for key, spec in FIELDS.items():
        if key not in record:
            raise ValueError(f"{where}: key {key!r} is missing ({spec.meaning})")
        value = record[key]
        if isinstance(value, bool) and bool not in spec.types:
            raise ValueError(f"{where}: {key!r} is a bool, should be {spec.type_name}")
        if not isinstance(value, spec.types):
            raise ValueError(
                f"{where}: {key!r} is {type(value).__name__} {value!r}, should be {spec.type_name}"
            )
        if spec.types is _NAMES and not all(isinstance(n, str) for n in value):
            raise ValueError(f"{where}: {key!r} must list names (str), got {value!r}")
    if record["clients"] != len(record["contributors"]):
        raise ValueError(
            f"{where}: clients = {record['clients']} but {len(record['contributors'])} "
            "contributors are named"
        )


def upgrade(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record of any age in today's meanings, for readers (`fedtrain report`).

    Before `record_version` the simulation wrote `clients` = selected, `reported` =
    counted updates and `dropped` / `rejected` as counts; a deployment wrote `selected`
    as a count and `clients` = contributors, as today. Counts that had no names stay
    counts (read them with `site_count`)."""
    out = dict(record)
    if "record_version" in out:
        return out
    if "reported" in out:  # an old simulation line
        out["selected"] = out.get("clients", 0)
        out["clients"] = out["reported"]
        if "rejected" in out:
            out.setdefault("failed", out["rejected"])
    return out


def site_count(value: Any) -> int:
    """How many sites a `dropped` / `failed` / `skipped` value names (old records: a count)."""
    if value is None:
        return 0
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    return len(value)


def readme_table() -> str:
    """The README's table of the record (`python -m fedtrain.docgen`)."""
    rows = [
        f"| `{key}` | {spec.type_name} | {spec.meaning} | "
        f"{'all' if spec.drivers == ALL_DRIVERS else ', '.join(spec.drivers)} |"
        for key, spec in FIELDS.items()
    ]
    families = [
        f"| `{keys}` | | {meaning} | {drivers} |" for keys, (meaning, drivers) in FAMILIES.items()
    ]
    return "\n".join(["| key | type | meaning | drivers |", "|---|---|---|---|", *rows, *families])


def worst_first(site_metrics: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Sites from worst to best as `worst_site` ranks them: by accuracy (lowest first)
    when every site reports one, else by loss (highest first); ties by name."""
    names = sorted(site_metrics)
    if all("accuracy" in site_metrics[s] for s in names):
        return sorted(names, key=lambda s: site_metrics[s]["accuracy"])
    return sorted(names, key=lambda s: -site_metrics[s]["loss"])


def describe_evaluation(ev: Mapping[str, Any], worst_site: str, *, secure: bool) -> str:
    """ "accuracy 0.9312 (federated: 3 sites), loss 0.2100, worst site b: accuracy
    0.7000, spread 0.2312" from an evaluated record's numbers (the server's round log
    line and `fedtrain status` say the same)."""
    figures = [f"{key} {ev[key]:.4f}" for key in ("accuracy", "loss") if ev.get(key) is not None]
    if figures and "eval_sites" in ev:
        how = ", secure" if secure else ""
        figures[0] += f" (federated{how}: {int(ev['eval_sites'])} sites)"
    parts = figures or ["no result"]
    if worst_site:
        worst = [
            f"{k[6:]} {ev[k]:.4f}"
            for k in ("worst_accuracy", "worst_loss")
            if ev.get(k) is not None
        ]
        parts.append(
            f"worst site {worst_site}: {worst[0]}" if worst else f"worst site {worst_site}"
        )
    if ev.get("site_spread") is not None:
        parts.append(f"spread {ev['site_spread']:.4f}")
    return ", ".join(parts)
