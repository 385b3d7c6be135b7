"""Prometheus metrics of one application instance.

Each app owns its ``CollectorRegistry`` so tests (and embedders) can build many apps in one
process without duplicate-timeseries errors. Labels are bounded: ``route`` is the matched
resource's canonical path (never the concrete URL), ``code`` a geometry refusal code.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

import kvroute

# Control-plane requests are database round trips: sub-millisecond to a few seconds.
HTTP_DURATION_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    registrations: Counter
    rejections: Counter
    live_ranks: Gauge
    http_duration: Histogram

    @classmethod
    def create(cls, *, database_backend: str) -> Metrics:
        registry = CollectorRegistry(auto_describe=True)
        build = Info("kvroute_build", "kvroute build information", registry=registry)
        build.info({"version": kvroute.__version__, "database": database_backend})
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
                "Registrations refused at the boundary, by refusal code",
                ["code"],
                registry=registry,
            ),
            live_ranks=Gauge(
                "kvroute_live_ranks",
                "Ranks whose lease has not expired",
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
