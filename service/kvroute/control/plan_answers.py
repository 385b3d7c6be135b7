"""Plans as HTTP answers: encoded once per (plan, generations, format), then served as bytes.

``PlanService`` already avoids re-planning while the generations a plan was built from are
current; this layer avoids re-encoding. A cached plan is answered with the bytes encoded when it
was first served (JSON, the text table or the SVG), so a hot plan read costs the generation
lookup and nothing proportional to the plan's size. The ETag names exactly what the bytes depend
on: the plan fingerprint (geometry of every input rank), the generations, the format and the
fragment form (``period``: every view pair with whole token rows in its period form, the others
marked ``token_rows: false`` in their block form; see ``geometry.plan_pairs``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from cachetools import LRUCache
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvroute.control.plans import (
    PlanKey,
    PlanService,
    PlanUnavailable,
    ServedPlan,
    require_complete,
)
from kvroute.geometry import GeometryError, Plan
from kvroute.pictures import plan_svg
from kvroute.render import plan_text
from kvroute.store.snapshots import instance_state

# A plan set is re-read when a sender rank re-registers between two of its plans; past this many
# reads the instance is changing too fast to answer one consistent set.
PLAN_SET_ATTEMPTS = 3

MEDIA_TYPES: dict[str, str] = {
    "json": "application/json",
    "text": "text/plain",
    "svg": "image/svg+xml",
}
# Planning is pure CPU: ~0.1 ms for small HND plans, tens of ms for per-token NHD plans.
PLAN_BUILD_BUCKETS_SECONDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.25, 1)
# Fragments per block: 1 for a fully coalesced view pair, layers x tokens for NHD head mismatch.
PLAN_FRAGMENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class PlanMetrics:
    requests: Counter
    cache_hits: Counter
    build_seconds: Histogram
    fragments: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PlanMetrics:
        return cls(
            requests=Counter(
                "kvroute_plan_requests_total",
                "Plan requests answered, by result "
                "(ok, not_modified, unavailable, incompatible, not_found)",
                ["result"],
                registry=registry,
            ),
            cache_hits=Counter(
                "kvroute_plan_cache_hits_total",
                "Plans answered from the cache without planning again",
                registry=registry,
            ),
            build_seconds=Histogram(
                "kvroute_plan_build_seconds",
                "Time to build one plan from its registrations",
                buckets=PLAN_BUILD_BUCKETS_SECONDS,
                registry=registry,
            ),
            fragments=Histogram(
                "kvroute_plan_fragments",
                "Fragments (copy descriptors) per block of each plan built",
                buckets=PLAN_FRAGMENT_BUCKETS,
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class EncodedPlan:
    """One plan in one format, with what a caller needs to check it against others."""

    etag: str
    body: bytes
    sender_generations: tuple[tuple[int, int], ...]
    receiver_generation: int


def encode_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


# Each format from the typed plan; JSON is written only here, at the edge.
ENCODERS: dict[str, Callable[[Plan], bytes]] = {
    "json": lambda plan: encode_json(plan.to_json()),
    "text": lambda plan: plan_text(plan).encode(),
    "svg": lambda plan: plan_svg(plan).encode(),
}


def _encode(plan_format: str, served: ServedPlan, period: bool) -> bytes:
    if plan_format == "json" and not period:
        return encode_json(served.document)  # written once, when the plan was built
    plan = replace(
        served.plan,
        sender_generations=served.sender_generations,
        receiver_generation=served.receiver_generation,
    )
    if period:
        try:
            plan = plan.period_form()
        except ValueError as error:  # a view pair without whole token rows has no period form
            raise GeometryError(
                "period_form_unavailable",
                f"fragments=period: {error}",
                field="fragments",
                local="period",
                peer="block",
                stage="plan",
            ) from error
    return ENCODERS[plan_format](plan)


def plan_version(served: ServedPlan) -> str:
    """Fingerprint and generations: equal versions mean byte-identical plan documents."""
    senders = ".".join(f"{rank}:{gen}" for rank, gen in sorted(served.sender_generations.items()))
    digest = served.plan.fingerprint.removeprefix("sha256:")
    return f"{digest}-{senders}-{served.receiver_generation}"


class PlanAnswers:
    """The plan endpoints' view of ``PlanService``: encoded bytes, cached per plan key."""

    def __init__(self, service: PlanService, metrics: PlanMetrics, *, cache_size: int = 4096):
        self.service = service
        self.metrics = metrics
        # Per key only the newest version is kept: an older one can never be current again.
        self._encoded: LRUCache[PlanKey, tuple[str, dict[str, bytes]]] = LRUCache(cache_size)

    async def answer(
        self, key: PlanKey, plan_format: str, *, now: datetime, period: bool = False
    ) -> EncodedPlan:
        served = await self.service.get(key, now=now)
        if served.cached:
            self.metrics.cache_hits.inc()
        else:
            if served.build_seconds is not None:
                self.metrics.build_seconds.observe(served.build_seconds)
            self.metrics.fragments.observe(served.plan.fragments_per_block)
        version = plan_version(served)
        entry = self._encoded.get(key)
        if entry is None or entry[0] != version:
            entry = (version, {})
            self._encoded[key] = entry
        form = f"{plan_format}-period" if period else plan_format
        body = entry[1].get(form)
        if body is None:
            # A per-token NHD plan encodes to megabytes: keep that off the event loop.
            body = await asyncio.to_thread(_encode, plan_format, served, period)
            entry[1][form] = body
        return EncodedPlan(
            etag=f'"{version}-{form}"',
            body=body,
            sender_generations=tuple(sorted(served.sender_generations.items())),
            receiver_generation=served.receiver_generation,
        )

    async def plan_set(
        self, key: PlanKey, plan_format: str, *, now: datetime, period: bool = False
    ) -> list[EncodedPlan]:
        """Plans of every rank of ``key``'s receiver instance, all from one set of sender generations."""
        sessionmaker = self.service.sessionmaker
        for _ in range(PLAN_SET_ATTEMPTS):
            receiver = await instance_state(sessionmaker, key.deployment, key.receiver, now=now)
            if receiver.role == "generation":  # other roles: the plans refuse them by role
                require_complete("receiver", receiver)
            plans = [
                await self.answer(
                    replace(key, receiver_rank=rank), plan_format, now=now, period=period
                )
                for rank in range(receiver.expected_ranks)
            ]
            if len({plan.sender_generations for plan in plans}) <= 1:
                return plans
        raise PlanUnavailable(
            f"sender instance {key.sender} re-registered ranks while its plans were read "
            f"{PLAN_SET_ATTEMPTS} times; retry"
        )
