"""Parsed registrations by generation: one process-wide cache for admission, plans, transfers and
the compatibility matrix.

A rank's document at a given generation never changes, so ``(deployment, instance, rank,
generation)`` identifies one immutable ``RankRegistration``. Callers first read generations (cheap
columns), then ask here for the registrations at exactly those generations; only the ones not yet
parsed are read, all in one query.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache
from sqlalchemy import ColumnElement, Row, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import QueryableAttribute

from kvroute.geometry import RankRegistration
from kvroute.store.engine import SessionMaker, autocommit_connection, engine_of, retry_disconnect
from kvroute.store.errors import Conflict
from kvroute.store.models import RankDocumentRow, RankRow

RankAt = tuple[str, int, int]  # instance, rank, generation
Column = ColumnElement[Any] | QueryableAttribute[Any]
DEFAULT_SIZE = 16_384  # a 1,024-rank fleet twice over, with room for re-registrations
# Most keys read by a row-value IN list; more are read by scanning the deployment. PostgreSQL
# refuses an IN list of a whole 8,192-rank deployment ("stack depth limit exceeded").
READ_CHUNK = 512
# A rank's row with its document (the foreign key names the join).
WITH_DOCUMENTS = RankRow.__table__.join(RankDocumentRow.__table__)


class RegistrationMoved(Conflict):
    """A rank re-registered or left between reading its generation and reading its document."""


Topology = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class RankClass:
    """What a whole-deployment answer reads of a rank it need not parse: its geometry class (the
    column admission wrote, ``RankRegistration.class_digest``) and, when asked, its topology."""

    instance: str
    rank: int
    class_digest: str
    topology: Topology | None  # None: not read


# A rank as ``RegistrationCache.classes_at`` answers it: the parsed registration when this process
# holds it, else its class.
RankSketch = RankRegistration | RankClass


class RegistrationCache:
    def __init__(self, sessionmaker: SessionMaker, *, size: int = DEFAULT_SIZE) -> None:
        self._sessionmaker = sessionmaker
        self._parsed: LRUCache[tuple[str, str, int, int], RankRegistration] = LRUCache(size)

    def __len__(self) -> int:
        """How many parsed registrations the cache holds."""
        return len(self._parsed)

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
        if missing:
            documents = await self._documents(deployment, missing, connection)
            for instance, rank, _ in missing:
                if (instance, rank) not in documents:
                    raise RegistrationMoved(
                        f"{instance} rank {rank} re-registered or left while it was read; retry"
                    )
            # Many large documents take a while to parse: not on the event loop.
            fresh = await asyncio.to_thread(_parse_all, deployment, missing, documents)
            for key, reg in zip(missing, fresh, strict=True):
                parsed[key] = reg
                self._parsed[deployment, *key] = reg
        return [parsed[key] for key in wanted]

    async def classes_at(
        self, deployment: str, wanted: Sequence[RankAt], *, topology: bool
    ) -> list[RankSketch]:
        """Each rank's parsed registration when this process holds it, else its class (and, with
        ``topology``, its topology) read from its columns: no document is parsed. Raises
        ``RegistrationMoved`` when a rank no longer has the generation asked for."""
        known = {key: reg for key in wanted if (reg := self._parsed.get((deployment, *key)))}
        missing = [key for key in wanted if key not in known]
        columns = _class_columns(topology)
        read = await self._read(deployment, missing, columns, documents=topology) if missing else {}
        found: dict[RankAt, RankSketch] = dict(known)
        for instance, rank, generation in missing:
            if (row := read.get((instance, rank))) is None:
                raise RegistrationMoved(
                    f"{instance} rank {rank} re-registered or left while it was read; retry"
                )
            # An absent topology reads as SQL NULL or JSON null: no domains, as when parsed.
            domains = tuple(sorted((row[1] or {}).items())) if topology else None
            found[instance, rank, generation] = RankClass(instance, rank, row[0], domains)
        return [found[key] for key in wanted]

    def remember(self, reg: RankRegistration, generation: int) -> None:
        """Keeps a registration this process just parsed (e.g. on admission)."""
        self._parsed[reg.deployment, reg.instance, reg.rank, generation] = reg

    async def _documents(
        self, deployment: str, wanted: list[RankAt], connection: AsyncConnection | None
    ) -> dict[tuple[str, int], dict[str, Any]]:
        read = await self._read(
            deployment, wanted, [RankDocumentRow.document], connection, documents=True
        )
        return {key: row[0] for key, row in read.items()}

    async def _read(
        self,
        deployment: str,
        wanted: list[RankAt],
        columns: Sequence[Column],
        connection: AsyncConnection | None = None,
        *,
        documents: bool = False,
    ) -> dict[tuple[str, int], tuple[Any, ...]]:
        """``columns`` of the ranks at exactly these generations, by (instance, rank); with
        ``documents``, of the ranks joined with their documents."""
        if not wanted:
            return {}
        keyed = [RankRow.instance, RankRow.rank, RankRow.generation]
        query = (
            select(*keyed, *columns)
            .select_from(WITH_DOCUMENTS if documents else RankRow.__table__)
            .where(RankRow.deployment == deployment)
        )
        if len(wanted) <= READ_CHUNK:
            query = query.where(tuple_(*keyed).in_(wanted))
        # Else (a cold replica's matrix wants the whole fleet) the deployment's rows are matched
        # here: PostgreSQL does not hash a row-value IN list, so chunks of one cost keys x rows.

        async def read_on(on: AsyncConnection) -> Sequence[Row[*tuple[Any, ...]]]:
            return (await on.execute(query)).all()

        if connection is not None:
            rows = await read_on(connection)
        else:

            async def read() -> Sequence[Row[*tuple[Any, ...]]]:
                async with autocommit_connection(engine_of(self._sessionmaker)) as own:
                    return await read_on(own)

            rows = await retry_disconnect(read)
        keys = set(wanted)
        return {(row[0], row[1]): tuple(row[3:]) for row in rows if tuple(row[:3]) in keys}


def _class_columns(topology: bool) -> list[Column]:
    # The topology is extracted by the database: the rest of the document is not sent.
    columns: list[Column] = [RankRow.geometry_class]
    return [*columns, RankDocumentRow.document["topology"]] if topology else columns


def _parse_all(
    deployment: str, wanted: Sequence[RankAt], documents: Mapping[tuple[str, int], Any]
) -> list[RankRegistration]:
    parsed = [
        RankRegistration.from_json(
            documents[instance, rank], deployment=deployment, instance=instance, rank=rank
        )
        for instance, rank, _ in wanted
    ]
    for reg in parsed:
        # Every reader asks for the class (admission, the matrix): digest it here, off the event
        # loop, rather than on first use (a cold replica's matrix would digest 8,192 on the loop).
        _ = reg.class_digest
    return parsed
