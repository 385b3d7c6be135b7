"""Prometheus metrics of the transfer worker pool, registered on a registry the caller owns.

No module-level metric objects: the HTTP layer passes its per-app ``CollectorRegistry`` so tests can
build many pools. Labels are bounded (a job's final state), never job or block ids.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Same-node copies of a few blocks take milliseconds; a large multi-rank job may take seconds.
DURATION_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
DURATION_BUCKETS_SECONDS += (2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter(
            "kvroute_transfer_jobs_total",
            "Transfer jobs that reached a final state",
            ["state"],
            registry=registry,
        )
        self.rejected = Counter(
            "kvroute_transfer_rejected_total",
            "Transfer jobs refused at submission",
            ["reason"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "kvroute_transfer_queue_depth", "Transfer jobs waiting for a worker", registry=registry
        )
        self.running = Gauge(
            "kvroute_transfer_running_jobs", "Transfer jobs being copied now", registry=registry
        )
        self.bytes = Counter(
            "kvroute_transfer_bytes_total", "Bytes copied by succeeded jobs", registry=registry
        )
        self.fragments = Counter(
            "kvroute_transfer_fragments_total",
            "Fragments x blocks copied by succeeded jobs",
            registry=registry,
        )
        self.duration = Histogram(
            "kvroute_transfer_duration_seconds",
            "Copy time of finished jobs, from start on a worker to completion on the device",
            buckets=DURATION_BUCKETS_SECONDS,
            registry=registry,
        )


class OpenPools(Protocol):
    """What the pool gauges read: ``PoolMemoryCache``'s counts."""

    def __len__(self) -> int: ...

    @property
    def open_descriptors(self) -> int: ...


def pool_gauges(registry: CollectorRegistry, pools: OpenPools) -> None:
    """Open pools and their descriptors, read from the cache at each scrape."""
    Gauge(
        "kvroute_open_pools",
        "Pools this process has mapped (shared by jobs; closed once idle and their rank is gone)",
        registry=registry,
    ).set_function(lambda: len(pools))
    Gauge(
        "kvroute_open_pool_descriptors",
        "File descriptors held by open pools (two per shm or memfd mapping)",
        registry=registry,
    ).set_function(lambda: pools.open_descriptors)
