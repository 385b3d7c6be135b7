"""Prometheus metrics of one application instance.

Each app owns its ``CollectorRegistry`` so tests (and embedders) can build many apps in one
process without duplicate-timeseries errors. Labels are bounded: ``route`` is the matched
resource's canonical path (never the concrete URL), ``code`` a geometry refusal code, and
``deployment``/``instance`` name what workers registered (a few per cluster, admitted only with
the worker token). ``instance`` labels only gauges, which are rebuilt from the registry so a gone
instance's series go with it; counters live forever, so they stop at ``deployment`` (instances
named after pods would otherwise pile up). No ``_created`` series: they double the line count and
no rule reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)

import kvroute
from kvroute.store.records import RankName

# Control-plane requests are database round trips: sub-millisecond to a few seconds.
HTTP_DURATION_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

disable_created_metrics()


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    registrations: Counter
    rejections: Counter
    live_ranks: Gauge
    expired_ranks: Gauge
    expired_leases: Counter
    database_up: Gauge
    http_duration: Histogram
    kv_paths: Gauge
    kv_digest_mismatches: Counter

    @classmethod
    def create(cls, *, database_backend: str) -> Metrics:
        registry = CollectorRegistry(auto_describe=True)
        build = Info("kvroute_build", "kvroute build information", registry=registry)
        build.info({"version": kvroute.__version__, "database": database_backend})
        instance = ["deployment", "instance"]
        return cls(
            registry=registry,
            registrations=Counter(
                "kvroute_registrations_total",
                "Rank registrations answered, by result (created, accepted, rejected)",
                ["result"],
                registry=registry,
            ),
            rejections=Counter(
                "kvroute_rejections_total",
                "Registrations refused at the boundary, by refusal code and deployment",
                ["code", "deployment"],
                registry=registry,
            ),
            live_ranks=Gauge(
                "kvroute_live_ranks",
                "Ranks whose lease has not expired",
                instance,
                registry=registry,
            ),
            expired_ranks=Gauge(
                "kvroute_expired_ranks",
                "Ranks whose lease expired and that the reaper has not removed yet",
                instance,
                registry=registry,
            ),
            expired_leases=Counter(
                "kvroute_expired_leases_total",
                "Leases that ended without renewal, as seen by this process's reaper",
                ["deployment"],
                registry=registry,
            ),
            database_up=Gauge(
                "kvroute_database_up",
                "1 when the last database read for metrics or leases succeeded, else 0",
                registry=registry,
            ),
            kv_paths=Gauge(
                "kvroute_kv_path_attestations",
                "KV transfer paths (producer instance x consumer rank) by integrity state: "
                "attested, failed, stale (registered again since its last canary)",
                ["deployment", "state"],
                registry=registry,
            ),
            # Instance labels on a counter, as the integrity issue asks: a mismatch is rare and
            # names the pair an operator must look at; the pairs keep no series until one fails.
            kv_digest_mismatches=Counter(
                "kvroute_kv_digest_mismatch_total",
                "Sampled requests whose received KV digest differed from the producer's",
                ["producer", "consumer"],
                registry=registry,
            ),
            http_duration=Histogram(
                "kvroute_http_request_duration_seconds",
                "HTTP request handling time",
                ["route", "method", "status_class"],
                buckets=HTTP_DURATION_BUCKETS_SECONDS,
                registry=registry,
            ),
        )

    def set_rank_counts(self, counts: Mapping[tuple[str, str], tuple[int, int]]) -> None:
        """Replaces the per-instance gauges: a deleted instance's series disappear."""
        self.live_ranks.clear()
        self.expired_ranks.clear()
        for (deployment, instance), (live, expired) in counts.items():
            self.live_ranks.labels(deployment=deployment, instance=instance).set(live)
            self.expired_ranks.labels(deployment=deployment, instance=instance).set(expired)

    def set_path_states(self, deployment: str, counts: Mapping[str, int]) -> None:
        for state, count in counts.items():
            self.kv_paths.labels(deployment=deployment, state=state).set(count)

    def count_digest_mismatch(self, producer: str, consumer: str) -> None:
        self.kv_digest_mismatches.labels(producer=producer, consumer=consumer).inc()

    def count_expired(self, expired: Iterable[tuple[RankName, datetime]]) -> None:
        for name, _ in expired:
            self.expired_leases.labels(deployment=name.deployment).inc()
