"""Prometheus metrics of the aggregation server (`metrics_port` in server.toml).

Three sources feed them, so the round loop needs no Prometheus code of its own:

- the live state (`ServerState` plus the byte totals), read by a collector at scrape
  time: connected sites, round, phase, bytes in and out;
- the audit log's records, which every admission decision and round outcome passes
  through: uploads accepted, rejected and aborted, refused joins and requests,
  dropouts, failed sites and failed round attempts;
- each completed round's metrics record: its duration, the evaluated accuracy and loss,
  and, after a plain federated evaluation, where the model does worst.

Per-site evaluation gauges stay bounded whatever the federation's size: only the
`SITE_GAUGES` worst sites of the last evaluation get a series (10,000 sites never
make 10,000 series; a site leaves the set once it is no longer among the worst), plus
the worst site and the spread. They come from the record's `site_metrics`, so the
privacy opt-out (`site_metrics = false`) and secure evaluation (the server never
learns a site's figures) leave them out too.

Each server gets its own `CollectorRegistry` (never the process-global one), so tests
and several servers in one process never clash. `METRICS` lists every name, for the
README's table and the tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedtrain.errors import ConfigError
from fedtrain.observability.status import PHASES, ServerState
from fedtrain.round_record import worst_first

log = logging.getLogger(__name__)

#: Round durations range from a fraction of a second (tests) to hours (large models).
ROUND_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)

#: Per-site evaluation series exported: the worst sites of the last evaluation.
SITE_GAUGES = 10

#: Every metric the server exports (Prometheus name -> meaning).
METRICS: dict[str, str] = {
    "fedtrain_run_info": "Always 1; labels run_id and task name the run.",
    "fedtrain_connected_sites": "Sites connected right now.",
    "fedtrain_sites_required": "Sites that must be connected before a round starts.",
    "fedtrain_site_last_seen_seconds": "Seconds since each connected site (label site) was heard.",
    "fedtrain_site_link_bits_per_second": (
        "Each site's link (labels site, direction down|up) as measured from its transfers."
    ),
    "fedtrain_site_transfer_bytes": (
        "Each transfer in flight (labels site, direction down|up, of done|total): bytes "
        "moved so far and its whole size (0 while unknown)."
    ),
    "fedtrain_site_transfer_idle_seconds": (
        "Seconds since each transfer in flight (labels site, direction) last moved a byte."
    ),
    "fedtrain_round": "The round in progress, or the last completed one between rounds.",
    "fedtrain_round_attempt": "Attempt of the round in progress (retried when too few report).",
    "fedtrain_rounds_completed": "Rounds completed in this run (survives --resume).",
    "fedtrain_rounds_planned": "Rounds the run is configured for.",
    "fedtrain_phase": "1 for the server's current phase (label phase), 0 for the others.",
    "fedtrain_secure_aggregation": "1 when the server runs secure aggregation.",
    "fedtrain_received_bytes_total": "Tensor bytes received from sites (uploads).",
    "fedtrain_sent_bytes_total": "Tensor bytes sent to sites (model downloads).",
    "fedtrain_received_bytes_by_outcome_total": (
        "Tensor bytes received, by what became of them (label outcome: accepted, in an "
        "update a round took; discarded, thrown away; resent, arrived a second time). "
        "Their sum falls short of fedtrain_received_bytes_total by the uploads in flight."
    ),
    "fedtrain_round_duration_seconds": "Duration of completed rounds (histogram).",
    "fedtrain_eval_accuracy": "Accuracy of the global model at its last evaluation (if any).",
    "fedtrain_eval_loss": "Loss of the global model at its last evaluation (if any).",
    "fedtrain_eval_sites": "Sites counted in the last federated evaluation.",
    "fedtrain_eval_worst_site_accuracy": (
        "Accuracy at the worst site (label site) of the last federated evaluation. Not "
        "under secure evaluation nor with site_metrics = false."
    ),
    "fedtrain_eval_site_spread": (
        "Best minus worst site's accuracy (or worst minus best loss) at the last "
        "federated evaluation; same conditions."
    ),
    "fedtrain_site_eval_accuracy": (
        f"Accuracy at each of the {SITE_GAUGES} worst sites (label site) of the last "
        f"federated evaluation: at most {SITE_GAUGES} series; same conditions."
    ),
    "fedtrain_site_eval_loss": (
        f"Loss at each of the {SITE_GAUGES} worst sites (label site); same conditions."
    ),
    "fedtrain_eval_personalized_accuracy": (
        "Accuracy of the sites' fine-tuned copies at the last evaluation (personalize_epochs)."
    ),
    "fedtrain_eval_personalized_loss": (
        "Loss of the sites' fine-tuned copies at the last evaluation (personalize_epochs)."
    ),
    "fedtrain_uploads_accepted_total": "Updates received whole and aggregated.",
    "fedtrain_uploads_rejected_total": "Uploads refused (label code: gRPC status sent).",
    "fedtrain_uploads_aborted_total": "Uploads whose stream broke off midway.",
    "fedtrain_requests_refused_total": "Bulk requests without a valid session (label code).",
    "fedtrain_joins_total": "Sites admitted (reconnects count again).",
    "fedtrain_joins_refused_total": "Joins refused (allow-list, fingerprint, version, ...).",
    "fedtrain_dropouts_total": "Chosen sites that left or missed the deadline, per round attempt.",
    "fedtrain_site_failures_total": "Chosen sites that reported an error, per round attempt.",
    "fedtrain_round_attempts_failed_total": "Round attempts retried for too few updates.",
}


class ServerMetrics:
    """One server's metrics: `on_audit` and `on_round` feed them, `serve` exposes them."""

    def __init__(
        self, state: Callable[[], ServerState], transfers: Callable[[], tuple[int, int]]
    ) -> None:
        self.registry = CollectorRegistry()
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

        def counter(name: str, labels: tuple[str, ...] = ()) -> Counter:
            base = name.removesuffix("_total")
            return Counter(base, METRICS[name], labels, registry=self.registry)

        self.uploads_accepted = counter("fedtrain_uploads_accepted_total")
        self.uploads_rejected = counter("fedtrain_uploads_rejected_total", ("code",))
        self.uploads_aborted = counter("fedtrain_uploads_aborted_total")
        self.requests_refused = counter("fedtrain_requests_refused_total", ("code",))
        self.joins = counter("fedtrain_joins_total")
        self.joins_refused = counter("fedtrain_joins_refused_total")
        self.dropouts = counter("fedtrain_dropouts_total")
        self.site_failures = counter("fedtrain_site_failures_total")
        self.attempts_failed = counter("fedtrain_round_attempts_failed_total")
        self.round_seconds = Histogram(
            "fedtrain_round_duration_seconds",
            METRICS["fedtrain_round_duration_seconds"],
            buckets=ROUND_SECONDS_BUCKETS,
            registry=self.registry,
        )
        #: The last evaluation (metric name -> value); absent until there was one.
        self.evaluation: dict[str, float] = {}
        #: The last evaluation's worst sites, worst first (see `SITE_GAUGES`).
        self.sites: SiteFigures = ()
        self.registry.register(
            LiveCollector(state, transfers, lambda: self.evaluation, lambda: self.sites)
        )

    # -- feeds --------------------------------------------------------------------------
    def on_audit(self, event: str, fields: Mapping[str, Any]) -> None:
        """Count one audit record (an `AuditLog` listener)."""
        if event == "upload":
            self.uploads_accepted.inc()
        elif event == "upload_rejected":
            self.uploads_rejected.labels(fields.get("code", "UNKNOWN")).inc()
        elif event == "upload_aborted":
            self.uploads_aborted.inc()
        elif event == "request_refused":
            self.requests_refused.labels(fields.get("code", "UNKNOWN")).inc()
        elif event == "join":
            self.joins.inc()
        elif event == "join_refused":
            self.joins_refused.inc()
        elif event in ("round_completed", "round_failed"):
            self.dropouts.inc(len(fields.get("dropped", ())))
            self.site_failures.inc(len(fields.get("failed", ())))
            if event == "round_failed":
                self.attempts_failed.inc()

    def on_round(self, record: Mapping[str, Any]) -> None:
        """Take a completed round's metrics record."""
        if record.get("seconds") is not None:
            self.round_seconds.observe(float(record["seconds"]))
        evaluated = {
            f"fedtrain_eval_{key}": float(record[source])
            for key, source in _EVALUATION.items()
            if record.get(source) is not None
        }
        if evaluated:  # replaced whole: a scrape on another thread never sees it change
            sites = worst_sites(record)
            evaluation = {**self.evaluation, **evaluated}
            if not sites:  # none this time: no per-site figure of an earlier one lingers
                evaluation.pop("fedtrain_eval_site_spread", None)
            self.evaluation, self.sites = evaluation, sites

    # -- the endpoint --------------------------------------------------------------------
    def serve(self, address: str, port: int) -> int:
        """Serve `http://address:port/metrics` on a daemon thread; returns the bound port."""
        try:
            self._httpd, self._thread = start_http_server(
                port, addr=address, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve Prometheus metrics on {address}:{port} (metrics_address, "
                f"metrics_port in server.toml): {exc}; pick a free port"
            ) from None
        bound = int(self._httpd.server_port)
        log.info("Prometheus metrics on http://%s:%d/metrics", address, bound)
        return bound

    def close(self) -> None:
        """Stop the endpoint (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


#: Prometheus name (after `fedtrain_eval_`) -> the record's key.
_EVALUATION = {
    "accuracy": "accuracy",
    "loss": "loss",
    "sites": "eval_sites",
    "site_spread": "site_spread",
    "personalized_accuracy": "personalized_accuracy",
    "personalized_loss": "personalized_loss",
}

#: (site, accuracy or None, loss or None), worst first.
SiteFigures = tuple[tuple[str, float | None, float | None], ...]


def worst_sites(record: Mapping[str, Any], limit: int = SITE_GAUGES) -> SiteFigures:
    """The record's `limit` worst sites with their figures (none without `site_metrics`)."""
    figures = record.get("site_metrics") or {}
    return tuple(
        (site, figures[site].get("accuracy"), figures[site].get("loss"))
        for site in worst_first(figures)[:limit]
    )


class LiveCollector(Collector):
    """What is true right now, read from the server at each scrape."""

    def __init__(
        self,
        state: Callable[[], ServerState],
        transfers: Callable[[], tuple[int, int]],
        evaluation: Callable[[], Mapping[str, float]],
        sites: Callable[[], SiteFigures] = lambda: (),
    ) -> None:
        self._state = state
        self._transfers = transfers
        self._evaluation = evaluation
        self._sites = sites

    def describe(self) -> list[Metric]:
        return []  # generated at scrape time; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        received, sent = self._transfers()
        info = GaugeMetricFamily(
            "fedtrain_run_info", METRICS["fedtrain_run_info"], labels=["run_id", "task"]
        )
        info.add_metric([s.run_id, s.task], 1)
        yield info
        for name, value in (
            ("fedtrain_connected_sites", len(s.sites)),
            ("fedtrain_sites_required", s.min_sites),
            ("fedtrain_round", s.round),
            ("fedtrain_round_attempt", s.attempt),
            ("fedtrain_rounds_completed", s.rounds_completed),
            ("fedtrain_rounds_planned", s.total_rounds),
            ("fedtrain_secure_aggregation", int(s.secagg)),
        ):
            yield GaugeMetricFamily(name, METRICS[name], value=value)
        for name, value in self._evaluation().items():  # none before the first evaluation
            yield GaugeMetricFamily(name, METRICS[name], value=value)
        yield from self._site_evaluation()
        seen = GaugeMetricFamily(
            "fedtrain_site_last_seen_seconds",
            METRICS["fedtrain_site_last_seen_seconds"],
            labels=["site"],
        )
        link = GaugeMetricFamily(
            "fedtrain_site_link_bits_per_second",
            METRICS["fedtrain_site_link_bits_per_second"],
            labels=["site", "direction"],
        )
        moved = GaugeMetricFamily(
            "fedtrain_site_transfer_bytes",
            METRICS["fedtrain_site_transfer_bytes"],
            labels=["site", "direction", "of"],
        )
        idle = GaugeMetricFamily(
            "fedtrain_site_transfer_idle_seconds",
            METRICS["fedtrain_site_transfer_idle_seconds"],
            labels=["site", "direction"],
        )
        for site in s.sites:
            seen.add_metric([site.name], site.last_heartbeat_age_s)
            for direction, bps in (("down", site.down_bps), ("up", site.up_bps)):
                if bps is not None:
                    link.add_metric([site.name, direction], 8 * bps)
            for t in site.transfers:
                moved.add_metric([site.name, t.direction, "done"], t.done_bytes)
                moved.add_metric([site.name, t.direction, "total"], t.total_bytes)
                idle.add_metric([site.name, t.direction], t.idle_s)
        yield from (seen, link, moved, idle)
        phase = GaugeMetricFamily("fedtrain_phase", METRICS["fedtrain_phase"], labels=["phase"])
        for name in PHASES:
            phase.add_metric([name], int(name == s.phase))
        yield phase
        for name, value in (
            ("fedtrain_received_bytes_total", received),
            ("fedtrain_sent_bytes_total", sent),
        ):
            yield CounterMetricFamily(name.removesuffix("_total"), METRICS[name], value=value)
        name = "fedtrain_received_bytes_by_outcome_total"
        split = CounterMetricFamily(name.removesuffix("_total"), METRICS[name], labels=["outcome"])
        for outcome in ("accepted", "discarded", "resent"):
            split.add_metric([outcome], s.bytes.get(outcome, 0))
        yield split

    def _site_evaluation(self) -> Iterator[Metric]:
        """The worst sites of the last evaluation (none under secure evaluation)."""
        sites = self._sites()
        if not sites:
            return
        site, accuracy, _ = sites[0]
        if accuracy is not None:
            worst = GaugeMetricFamily(
                "fedtrain_eval_worst_site_accuracy",
                METRICS["fedtrain_eval_worst_site_accuracy"],
                labels=["site"],
            )
            worst.add_metric([site], accuracy)
            yield worst
        for key, index in (("accuracy", 1), ("loss", 2)):
            name = f"fedtrain_site_eval_{key}"
            family = GaugeMetricFamily(name, METRICS[name], labels=["site"])
            for figures in sites:
                value = figures[index]
                if value is not None:
                    family.add_metric([figures[0]], value)
            yield family
