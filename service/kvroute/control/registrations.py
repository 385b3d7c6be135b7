"""Parsed registrations by generation: one process-wide cache for plans, transfers and the matrix.

A rank's document at a given generation never changes, so ``(deployment, instance, rank,
generation)`` identifies one immutable ``RankRegistration``. Callers first read generations (cheap
columns), then ask here for the registrations at exactly those generations; only the ones not yet
parsed are read, all in one query.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachetools import LRUCache

from kvroute.geometry import RankRegistration
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import Conflict
from kvroute.store.snapshots import rank_documents

RankAt = tuple[str, int, int]  # instance, rank, generation
DEFAULT_SIZE = 16_384  # a 1,024-rank fleet twice over, with room for re-registrations


class RegistrationMoved(Conflict):
    """A rank re-registered or left between reading its generation and reading its document."""


class RegistrationCache:
    def __init__(self, sessionmaker: SessionMaker, *, size: int = DEFAULT_SIZE) -> None:
        self._sessionmaker = sessionmaker
        self._parsed: LRUCache[tuple[str, str, int, int], RankRegistration] = LRUCache(size)

    async def at(self, deployment: str, wanted: Sequence[RankAt]) -> list[RankRegistration]:
        """The registrations at exactly these generations, in ``wanted`` order.

        Raises ``RegistrationMoved`` when a rank no longer has the generation asked for.
        """
        parsed: dict[RankAt, RankRegistration] = {}
        for key in wanted:
            if (reg := self._parsed.get((deployment, *key))) is not None:
                parsed[key] = reg
        missing = [key for key in wanted if key not in parsed]
        documents = await rank_documents(self._sessionmaker, deployment, missing)
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
