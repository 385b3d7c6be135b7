"""Parsed registrations by generation: one process-wide cache for admission, plans, transfers and
the compatibility matrix.

A rank's document at a given generation never changes, so ``(deployment, instance, rank,
generation)`` identifies one immutable ``RankRegistration``. Callers first read generations (cheap
columns), then ask here for the registrations at exactly those generations; only the ones not yet
parsed are read, all in one query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachetools import LRUCache
from sqlalchemy import Row, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.geometry import RankRegistration
from kvroute.store.engine import SessionMaker, autocommit_connection, engine_of, retry_disconnect
from kvroute.store.errors import Conflict
from kvroute.store.models import Rank

RankAt = tuple[str, int, int]  # instance, rank, generation
DEFAULT_SIZE = 16_384  # a 1,024-rank fleet twice over, with room for re-registrations


class RegistrationMoved(Conflict):
    """A rank re-registered or left between reading its generation and reading its document."""


class RegistrationCache:
    def __init__(self, sessionmaker: SessionMaker, *, size: int = DEFAULT_SIZE) -> None:
        self._sessionmaker = sessionmaker
        self._parsed: LRUCache[tuple[str, str, int, int], RankRegistration] = LRUCache(size)

    async def at(
        self,
        deployment: str,
        wanted: Sequence[RankAt],
        connection: AsyncConnection | None = None,
    ) -> list[RankRegistration]:
        """The registrations at exactly these generations, in ``wanted`` order.

        Missing documents are read on ``connection`` when given (inside the caller's transaction),
        else on a connection of their own. Raises ``RegistrationMoved`` when a rank no longer has
        the generation asked for.
        """
        parsed: dict[RankAt, RankRegistration] = {}
        for key in wanted:
            if (reg := self._parsed.get((deployment, *key))) is not None:
                parsed[key] = reg
        missing = [key for key in wanted if key not in parsed]
        documents = await self._documents(deployment, missing, connection)
        for instance, rank, generation in missing:
            document = documents.get((instance, rank))
            if document is None:
                raise RegistrationMoved(
                    f"{instance} rank {rank} re-registered or left while it was read; retry"
                )
            reg = RankRegistration.from_json(
                document, deployment=deployment, instance=instance, rank=rank
            )
            parsed[instance, rank, generation] = reg
            self._parsed[deployment, instance, rank, generation] = reg
        return [parsed[key] for key in wanted]

    def remember(self, reg: RankRegistration, generation: int) -> None:
        """Keeps a registration this process just parsed (e.g. on admission)."""
        self._parsed[reg.deployment, reg.instance, reg.rank, generation] = reg

    async def _documents(
        self, deployment: str, wanted: list[RankAt], connection: AsyncConnection | None
    ) -> dict[tuple[str, int], dict[str, Any]]:
        if not wanted:
            return {}
        query = select(Rank.instance, Rank.rank, Rank.document).where(
            Rank.deployment == deployment,
            tuple_(Rank.instance, Rank.rank, Rank.generation).in_(wanted),
        )
        if connection is not None:
            rows = (await connection.execute(query)).all()
        else:

            async def read() -> Sequence[Row[Any]]:
                async with autocommit_connection(engine_of(self._sessionmaker)) as own:
                    return (await own.execute(query)).all()

            rows = await retry_disconnect(read)
        return {(instance, rank): document for instance, rank, document in rows}
