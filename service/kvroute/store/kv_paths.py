"""KV integrity outcomes per transfer path: a producer (context) instance to one consumer
(generation) rank, as a worker reports its canary or a sampled digest.

A report is stamped with the registrations it holds for: the generation of every live producer
rank and of the consumer rank, read in the same transaction under the deployment lock, so a report
racing a re-registration is either before it (and read back stale) or after it. A failure appends
a ``kv_path_failed`` event in that transaction. Reads judge each outcome against the live
generations: a path whose producer or consumer registered again since (or is gone) reads ``stale``
and must be attested again; it is neither trusted nor excluded. A failure holds for the
registrations it was found with: a later ``attested`` report for the same generations (a request
whose digests agreed, a canary) does not lift it, since bytes that were moved wrong once say
more about the path than any number that were moved right; only a re-registration does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select

from kvroute import wire
from kvroute.store import events
from kvroute.store import ranks as repo
from kvroute.store.engine import SessionMaker, reading, retry_disconnect
from kvroute.store.errors import NotFound
from kvroute.store.models import KvPathRow, RankRow

FAILED_EVENT = "kv_path_failed"


@dataclass(frozen=True, slots=True)
class PathReport:
    """What a worker reports of one path."""

    producer: str
    consumer: str
    consumer_rank: int
    state: str  # attested | failed
    source: str  # canary | digest
    element: dict[str, Any] | None = None
    cost_ms: float | None = None


async def _live(session: Any, deployment: str, instance: str, now: datetime) -> dict[int, int]:
    rows = await session.execute(
        select(RankRow.rank, RankRow.generation).where(
            RankRow.deployment == deployment,
            RankRow.instance == instance,
            RankRow.lease_expires_at > now,
        )
    )
    return {rank: generation for rank, generation in rows}


async def record_path(
    sessionmaker: SessionMaker, deployment: str, report: PathReport, *, now: datetime
) -> wire.KvPath:
    """Stores ``report`` as the path's outcome, unless it attests a path whose failure still holds
    (the failure is answered); ``NotFound`` when the producer has no live rank or the consumer
    rank is not live."""
    async with sessionmaker.begin() as session:
        await repo.lock_deployment(session, deployment)
        producer = await _live(session, deployment, report.producer, now)
        consumer = await _live(session, deployment, report.consumer, now)
        if not producer:
            raise NotFound(f"producer instance {report.producer!r} has no live rank")
        if report.consumer_rank not in consumer:
            raise NotFound(
                f"rank {report.consumer_rank} of consumer instance {report.consumer!r} is not live"
            )
        key = (
            KvPathRow.deployment == deployment,
            KvPathRow.producer == report.producer,
            KvPathRow.consumer == report.consumer,
            KvPathRow.consumer_rank == report.consumer_rank,
        )
        row = {
            "deployment": deployment,
            "producer": report.producer,
            "consumer": report.consumer,
            "consumer_rank": report.consumer_rank,
            "producer_generations": {str(rank): gen for rank, gen in sorted(producer.items())},
            "consumer_generation": consumer[report.consumer_rank],
            "state": report.state,
            "source": report.source,
            "element": report.element,
            "cost_ms": report.cost_ms,
            "reported_at": now,
        }
        if report.state == "attested":
            held = await _held_failure(session, key, row)
            if held is not None:
                return _path(held, "failed")
        await session.execute(delete(KvPathRow).where(*key))
        await session.execute(insert(KvPathRow).values(**row))
        if report.state == "failed":
            await events.append(await session.connection(), deployment, [_failed(row)], now)
    return _path(row, report.state)


async def _held_failure(session: Any, key: tuple[Any, ...], row: dict[str, Any]) -> Any:
    """The path's stored failure when it holds for the generations ``row`` is stamped with."""
    stored = (await session.execute(select(KvPathRow.__table__).where(*key))).mappings().first()
    if stored is None or stored["state"] != "failed":
        return None
    same = (
        stored["consumer_generation"] == row["consumer_generation"]
        and dict(stored["producer_generations"]) == row["producer_generations"]
    )
    return dict(stored) if same else None


def _failed(row: dict[str, Any]) -> events.Change:
    data = {
        "producer": row["producer"],
        "source": row["source"],
        "element": row["element"],
        "producer_generations": row["producer_generations"],
    }
    return events.Change(
        FAILED_EVENT, row["consumer"], row["consumer_rank"], row["consumer_generation"], data
    )


async def read_paths(sessionmaker: SessionMaker, deployment: str, *, now: datetime) -> wire.KvPaths:
    """Every reported path of the deployment, judged against the live generations."""

    async def read() -> wire.KvPaths:
        async with reading(sessionmaker) as session:
            rows = (
                (
                    await session.execute(
                        select(KvPathRow.__table__)
                        .where(KvPathRow.deployment == deployment)
                        .order_by(KvPathRow.producer, KvPathRow.consumer, KvPathRow.consumer_rank)
                    )
                )
                .mappings()
                .all()
            )
            live: dict[str, dict[int, int]] = {}
            for name in sorted({r["producer"] for r in rows} | {r["consumer"] for r in rows}):
                live[name] = await _live(session, deployment, name, now)
        paths = tuple(_path(dict(row), _state(row, live)) for row in rows)
        return wire.KvPaths(deployment=deployment, paths=paths)

    return await retry_disconnect(read)


async def deployments_with_paths(sessionmaker: SessionMaker) -> list[str]:
    async def read() -> list[str]:
        async with reading(sessionmaker) as session:
            found = await session.scalars(select(KvPathRow.deployment).distinct())
            return sorted(found)

    return await retry_disconnect(read)


def _state(row: Any, live: dict[str, dict[int, int]]) -> str:
    producer = {str(rank): gen for rank, gen in sorted(live[row["producer"]].items())}
    current = live[row["consumer"]].get(row["consumer_rank"]) == row["consumer_generation"]
    fresh = current and producer == row["producer_generations"]
    return str(row["state"]) if fresh else "stale"


def _path(row: dict[str, Any], state: str) -> wire.KvPath:
    return wire.KvPath(
        producer=row["producer"],
        consumer=row["consumer"],
        consumer_rank=row["consumer_rank"],
        state=state,
        reported=row["state"],
        source=row["source"],
        reported_at=row["reported_at"],
        producer_generations=dict(row["producer_generations"]),
        consumer_generation=row["consumer_generation"],
        element=row["element"],
        cost_ms=row["cost_ms"],
    )
