"""Sampled KV digests in transit: a producer rank stores its digest of a request's blocks, the
consumer ranks that pull the request read every producer rank's and compare (``client.kv_digest``).

Digests are short-lived: one is read within a pull's bound of being written, so rows older than
``KEEP`` are trimmed whenever one is written. A repeated write of the same rank's digest replaces it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, insert, select

from kvroute.store.engine import SessionMaker, reading, retry_disconnect
from kvroute.store.models import KvDigestRow

KEEP = timedelta(minutes=10)


async def put_digest(
    sessionmaker: SessionMaker,
    deployment: str,
    key: tuple[str, str, int],
    digest: dict[str, Any],
    *,
    now: datetime,
) -> None:
    """Stores producer rank ``key`` = (producer, request id, rank)'s digest."""
    producer, request_id, rank = key
    async with sessionmaker.begin() as session:
        await session.execute(delete(KvDigestRow).where(KvDigestRow.at < now - KEEP))
        await session.execute(
            delete(KvDigestRow).where(
                KvDigestRow.deployment == deployment,
                KvDigestRow.producer == producer,
                KvDigestRow.request_id == request_id,
                KvDigestRow.rank == rank,
            )
        )
        await session.execute(
            insert(KvDigestRow).values(
                deployment=deployment,
                producer=producer,
                request_id=request_id,
                rank=rank,
                digest=digest,
                at=now,
            )
        )


async def get_digests(
    sessionmaker: SessionMaker, deployment: str, producer: str, request_id: str
) -> dict[int, dict[str, Any]]:
    """Producer rank -> its digest of the request (empty when none is stored yet)."""

    async def read() -> dict[int, dict[str, Any]]:
        async with reading(sessionmaker) as session:
            rows = await session.execute(
                select(KvDigestRow.rank, KvDigestRow.digest)
                .where(
                    KvDigestRow.deployment == deployment,
                    KvDigestRow.producer == producer,
                    KvDigestRow.request_id == request_id,
                )
                .order_by(KvDigestRow.rank)
            )
            return {rank: digest for rank, digest in rows}

    return await retry_disconnect(read)
