"""The KV integrity answers' shapes: per transfer path (a producer instance to one consumer rank),
its latest canary or digest outcome and whether it still holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvroute.wire.codec import OMIT_NONE

PATH_STATES = ("attested", "failed", "stale")  # stale: either side registered again since
REPORTED_STATES = ("attested", "failed")
SOURCES = ("canary", "digest")


@dataclass(frozen=True, slots=True)
class KvPath:
    """One path's latest outcome. ``element`` names the first wrong element of a failure (layer,
    head, token, kv and a ``detail`` sentence); ``reported`` is the state as reported, ``state``
    what it means now."""

    producer: str
    consumer: str
    consumer_rank: int
    state: str
    reported: str
    source: str
    reported_at: datetime
    producer_generations: dict[str, Any]  # producer rank -> generation when reported
    consumer_generation: int
    element: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)
    cost_ms: float | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True, slots=True)
class KvPaths:
    """``GET /v1/deployments/{d}/kv-paths``: every reported path, by producer, consumer, rank."""

    deployment: str
    paths: tuple[KvPath, ...]
