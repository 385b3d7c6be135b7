"""KV integrity per transfer path (``store.kv_paths``): workers report canary and digest outcomes,
operators and routers read them, and the pairs answer leaves out a pair with a failed path.

A pair (generation instance, context instance) is excluded while any consumer rank's outcome with
that producer is a failure that still holds (``kv_path_failed``): later attestations for the same
registrations do not lift it; a re-registration of either side makes the outcome stale, which lifts
the exclusion until the next canary reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvroute import wire
from kvroute.store import kv_digests as digests
from kvroute.store import kv_paths as store
from kvroute.store.engine import SessionMaker

EXCLUSION = "kv_path_failed"
FailedPaths = Mapping[tuple[str, str], wire.KvPath]  # (consumer, producer) -> first failed path


async def report_path(
    sessionmaker: SessionMaker, deployment: str, body: Mapping[str, Any], *, now: datetime
) -> wire.KvPath:
    """Stores a worker's report (a validated ``KvPathReport`` body)."""
    report = store.PathReport(
        producer=body["producer"],
        consumer=body["consumer"],
        consumer_rank=body["consumer_rank"],
        state=body["state"],
        source=body["source"],
        element=body.get("element"),
        cost_ms=body.get("cost_ms"),
    )
    return await store.record_path(sessionmaker, deployment, report, now=now)


async def read_paths(sessionmaker: SessionMaker, deployment: str, *, now: datetime) -> wire.KvPaths:
    return await store.read_paths(sessionmaker, deployment, now=now)


async def failed_paths(
    sessionmaker: SessionMaker, deployment: str, *, now: datetime
) -> FailedPaths:
    """The failures that hold, by (consumer, producer) instance: the lowest consumer rank's."""
    paths = (await store.read_paths(sessionmaker, deployment, now=now)).paths
    failed: dict[tuple[str, str], wire.KvPath] = {}
    for path in paths:
        if path.state == "failed":
            failed.setdefault((path.consumer, path.producer), path)
    return failed


def exclusion(path: wire.KvPath) -> dict[str, Any]:
    """The pairs answer's reason for a pair with a failed path."""
    element = path.element or {}
    where = element.get("detail") or "no element named"
    return {
        "code": EXCLUSION,
        "field": None,
        "detail": (
            f"the {path.source} of rank {path.consumer_rank} from {path.producer} failed "
            f"({where}); requests are not routed over it until either side registers again "
            "and a canary attests it"
        ),
        "local": {"rank": path.consumer_rank, "element": path.element},
        "peer": path.producer_generations,
    }


async def all_state_counts(
    sessionmaker: SessionMaker, *, now: datetime
) -> dict[str, dict[str, int]]:
    """deployment -> path state -> paths, for the metrics scrape."""
    return {
        deployment: state_counts(await store.read_paths(sessionmaker, deployment, now=now))
        for deployment in await store.deployments_with_paths(sessionmaker)
    }


def state_counts(paths: wire.KvPaths) -> dict[str, int]:
    counts = dict.fromkeys(wire.PATH_STATES, 0)
    for path in paths.paths:
        counts[path.state] += 1
    return counts


async def put_digest(
    sessionmaker: SessionMaker, deployment: str, body: Mapping[str, Any], *, now: datetime
) -> None:
    """Stores a producer rank's digest (a validated ``KvDigestUpload`` body)."""
    key = (body["producer"], body["request_id"], body["rank"])
    await digests.put_digest(sessionmaker, deployment, key, body["digest"], now=now)


async def get_digests(
    sessionmaker: SessionMaker, deployment: str, producer: str, request_id: str
) -> dict[str, Any]:
    found = await digests.get_digests(sessionmaker, deployment, producer, request_id)
    return {
        "deployment": deployment,
        "producer": producer,
        "request_id": request_id,
        "ranks": [{"rank": rank, "digest": digest} for rank, digest in found.items()],
    }
