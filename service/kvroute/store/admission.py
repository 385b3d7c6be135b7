"""Admission: registrations checked and stored in one transaction per batch, at a cost independent
of the deployment's size.

Inside the deployment lock (``ranks.lock_deployment``) a batch of candidates of one deployment:

1. moves the deployment's ``checked_at`` to ``at = max(now, checked_at)`` (the instant every lease
   is judged at) in the same statement that creates the deployment row if needed;
2. fences every rank of the deployment whose lease ended by ``at``: a fenced rank can never be
   renewed by a heartbeat, because no admission after this one checks against it. The fence
   statement waits for a heartbeat still committing on such a row and then sees the renewal, so
   the rank is read as live below and checked; a heartbeat that comes later finds the fence;
3. reads, in one statement, every row of the candidates' instances and one representative per
   geometry class of the live ranks of each role a candidate checks against (the first in
   (instance, rank) order: see ``geometry.classes``); parsed registrations come from the
   process-wide cache by generation, so only documents never seen before are read and parsed;
4. checks the candidates in order, each against the members of its instance and the class
   representatives of the opposite role as the candidates admitted before it left them (exactly
   the answers admitting them one by one would give), verdicts memoized per class pair;
5. writes the admitted ones with a fixed number of statements (``rank_writes``).

A candidate that replaces a live rank with a document of another class ends the batch after it:
that class's next member was never read, so later candidates could not be checked against it.
The deferred candidates come back to the caller, which admits them in a new batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, literal, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.geometry import GeometryError, RankRegistration, Role
from kvroute.geometry.classes import VerdictMemo, check_peers_by_class
from kvroute.geometry.instance import check_instance
from kvroute.geometry.validate import check_self
from kvroute.store import ranks as repo
from kvroute.store.engine import (
    READ_ONLY,
    SessionMaker,
    engine_of,
    reader_engine,
    retry_disconnect,
)
from kvroute.store.models import Deployment, Rank
from kvroute.store.rank_writes import Existing, greatest, upsert, write_admitted
from kvroute.store.records import RegisterOutcome
from kvroute.store.registrations import RankAt, RegistrationCache

RANKS = Rank.__table__
Outcome = RegisterOutcome | GeometryError


@dataclass
class BatchResult:
    """Outcomes of the candidates admitted or refused, in order; ``deferred`` were not looked at."""

    outcomes: list[Outcome] = field(default_factory=list)
    deferred: list[RankRegistration] = field(default_factory=list)


@dataclass
class _Peers:
    """What the batch reads: rows of the candidates' instances and each role's class firsts."""

    # (instance, rank) -> generation, canonical digest, geometry class, lease expiry
    rows: dict[tuple[str, int], tuple[int, str, str, datetime]]
    firsts: dict[Role, dict[str, RankAt]]  # role -> class -> its first live rank


async def admit(
    sessionmaker: SessionMaker,
    reg: RankRegistration,
    *,
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> RegisterOutcome:
    """Admits, renews or re-registers ``reg`` alone; raises its ``GeometryError`` changing nothing."""
    await prepare(reg)
    result = await admit_batch(
        sessionmaker, [reg], now=now, registrations=registrations, verdicts=verdicts
    )
    (outcome,) = result.outcomes
    if isinstance(outcome, GeometryError):
        raise outcome
    return outcome


async def prepare(reg: RankRegistration) -> None:
    """What needs no lock: the document's own checks (raises) and its digests, off the loop
    (milliseconds for the largest documents)."""
    await asyncio.to_thread(_check_and_digest, reg)


def _check_and_digest(reg: RankRegistration) -> None:
    check_self(reg)
    _ = reg.class_digest, reg.canonical_digest


async def admit_batch(
    sessionmaker: SessionMaker,
    candidates: Sequence[RankRegistration],
    *,
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> BatchResult:
    """Admits, renews or refuses ``candidates`` (one deployment, distinct ranks, self-checked)."""

    async def attempt() -> BatchResult:
        async with engine_of(sessionmaker).begin() as connection:
            return await _admit(connection, candidates, now, registrations, verdicts)

    result = await retry_disconnect(attempt)
    for reg, outcome in zip(candidates, result.outcomes, strict=False):
        if isinstance(outcome, RegisterOutcome):
            registrations.remember(reg, outcome.generation)
    return result


async def _admit(
    connection: AsyncConnection,
    candidates: Sequence[RankRegistration],
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> BatchResult:
    deployment = candidates[0].deployment
    await repo.lock_deployment_connection(connection, deployment)
    at = await _judge_at(connection, deployment, now)
    await _fence_expired(connection, deployment, at)
    peers = await _read_peers(connection, candidates, at)
    state = await _State.load(connection, registrations, deployment, peers, at)
    outcomes: list[Outcome | None] = []
    admitted: list[tuple[int, RankRegistration, Existing | None]] = []
    deferred: list[RankRegistration] = []
    for index, reg in enumerate(candidates):
        try:
            state.check(reg, verdicts)
        except GeometryError as error:
            outcomes.append(error)
            continue
        old = peers.rows.get(reg.key)
        admitted.append((len(outcomes), reg, Existing(old[0], old[1]) if old else None))
        outcomes.append(None)  # filled in once written
        if state.admit(reg, old, at):
            deferred = list(candidates[index + 1 :])
            break
    if not admitted:  # a refusal changes nothing: not checked_at, no fence, no deployment row
        await connection.rollback()
        return BatchResult([outcome for outcome in outcomes if outcome is not None], deferred)
    stored = await write_admitted(connection, [(reg, old) for _, reg, old in admitted], at)
    for (position, _, _), outcome in zip(admitted, stored, strict=True):
        outcomes[position] = outcome
    return BatchResult([outcome for outcome in outcomes if outcome is not None], deferred)


class _State:
    """The registry as the batch's candidates see it, updated as each one is admitted."""

    def __init__(
        self,
        members: dict[str, dict[int, RankRegistration]],
        firsts: dict[Role, dict[str, RankRegistration]],
    ) -> None:
        self.members = members  # instance -> rank -> live registration
        self.firsts = firsts  # role -> class -> first live registration

    @classmethod
    async def load(
        cls,
        connection: AsyncConnection,
        registrations: RegistrationCache,
        deployment: str,
        peers: _Peers,
        at: datetime,
    ) -> _State:
        live = [
            (instance, rank, generation)
            for (instance, rank), (generation, _, _, expires) in peers.rows.items()
            if expires > at
        ]
        firsts = [
            (role, digest, where)
            for role, by_class in peers.firsts.items()
            for digest, where in by_class.items()
        ]
        wanted = live + [where for _, _, where in firsts]
        parsed = await registrations.at(deployment, wanted, connection)
        members: dict[str, dict[int, RankRegistration]] = {}
        for reg in parsed[: len(live)]:
            members.setdefault(reg.instance, {})[reg.rank] = reg
        by_role: dict[Role, dict[str, RankRegistration]] = {role: {} for role in Role}
        for (role, digest, _), reg in zip(firsts, parsed[len(live) :], strict=True):
            by_role[role][digest] = reg
        return cls(members, by_role)

    def check(self, reg: RankRegistration, verdicts: VerdictMemo) -> None:
        instance = self.members.get(reg.instance, {})
        check_instance(reg, [member for rank, member in instance.items() if rank != reg.rank])
        check_peers_by_class(reg, list(self.firsts[reg.role.opposite].values()), verdicts)

    def admit(
        self, reg: RankRegistration, old: tuple[int, str, str, datetime] | None, at: datetime
    ) -> bool:
        """Records ``reg`` as live; True when the batch must end after it (see the module)."""
        self.members.setdefault(reg.instance, {})[reg.rank] = reg
        first = self.firsts[reg.role].get(reg.class_digest)
        if first is None or (reg.instance, reg.rank) < (first.instance, first.rank):
            self.firsts[reg.role][reg.class_digest] = reg
        return old is not None and old[3] > at and old[2] != reg.class_digest


async def dry_run(
    sessionmaker: SessionMaker,
    candidates: Sequence[RankRegistration],
    *,
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> tuple[int, GeometryError | None]:
    """What admitting ``candidates`` (one deployment, distinct ranks) one by one would answer, up to
    the first refusal: (its index, the refusal), or (len, None). The same checks as ``_admit``
    against the same reads, in a read-only transaction that writes nothing: no deployment row, no
    ``checked_at``, no fence, no rejection log entry."""
    for index, reg in enumerate(candidates):
        try:
            await prepare(reg)
        except GeometryError as error:
            return index, error

    async def attempt() -> tuple[int, GeometryError | None]:
        async with reader_engine(engine_of(sessionmaker)).connect() as connection:
            connection = await connection.execution_options(**{READ_ONLY: True})
            async with connection.begin():
                at = await _checked_at(connection, candidates[0].deployment, now)
                peers = await _read_peers(connection, candidates, at)
                state = await _State.load(
                    connection, registrations, candidates[0].deployment, peers, at
                )
                for index, reg in enumerate(candidates):
                    try:
                        state.check(reg, verdicts)
                    except GeometryError as error:
                        return index, error
                    state.admit(reg, peers.rows.get(reg.key), at)
        return len(candidates), None

    return await retry_disconnect(attempt)


async def _checked_at(connection: AsyncConnection, deployment: str, now: datetime) -> datetime:
    """``max(now, checked_at)`` as ``_judge_at`` would set it, without writing it."""
    table = Deployment.__table__
    stored = await connection.scalar(select(table.c.checked_at).where(table.c.name == deployment))
    return now if stored is None or stored < now else stored


async def _judge_at(connection: AsyncConnection, deployment: str, now: datetime) -> datetime:
    """Creates the deployment or moves its ``checked_at`` forward to ``max(now, checked_at)``."""
    table = Deployment.__table__
    statement = upsert(connection, table).values(name=deployment, created_at=now, checked_at=now)
    newest = greatest(connection, table.c.checked_at, statement.excluded.checked_at)
    statement = statement.on_conflict_do_update(
        index_elements=[table.c.name], set_={"checked_at": newest}
    ).returning(table.c.checked_at)
    return (await connection.execute(statement)).scalar_one()


async def _fence_expired(connection: AsyncConnection, deployment: str, at: datetime) -> None:
    await connection.execute(
        update(RANKS)
        .where(
            RANKS.c.deployment == deployment,
            RANKS.c.lease_expires_at <= at,
            RANKS.c.fenced_at.is_(None),
        )
        .values(fenced_at=at)
    )


async def _read_peers(
    connection: AsyncConnection, candidates: Sequence[RankRegistration], at: datetime
) -> _Peers:
    """In one statement: every row of the candidates' instances (live or not), and the first
    live rank (instance, rank order) of each geometry class of each role checked against."""
    deployment = candidates[0].deployment
    roles = sorted({reg.role.opposite.value for reg in candidates})
    position = func.row_number().over(
        partition_by=(RANKS.c.role, RANKS.c.geometry_class),
        order_by=(RANKS.c.instance, RANKS.c.rank),
    )
    columns = (
        RANKS.c.instance,
        RANKS.c.rank,
        RANKS.c.role,
        RANKS.c.generation,
        RANKS.c.canonical_sha256,
        RANKS.c.geometry_class,
        RANKS.c.lease_expires_at,
    )
    live = (
        select(*columns, position.label("position"))
        .where(
            RANKS.c.deployment == deployment,
            RANKS.c.role.in_(roles),
            RANKS.c.lease_expires_at > at,
        )
        .subquery()
    )
    own = select(*columns, literal(0).label("position")).where(
        RANKS.c.deployment == deployment,
        RANKS.c.instance.in_(sorted({reg.instance for reg in candidates})),
    )
    rows = await connection.execute(own.union_all(select(live).where(live.c.position == 1)))
    peers = _Peers({}, {Role(role): {} for role in roles})
    for instance, rank, role, generation, digest, geometry, expires, first in rows:
        if first:
            peers.firsts[Role(role)][geometry] = (instance, rank, generation)
        else:
            peers.rows[instance, rank] = (generation, digest, geometry, expires)
    return peers
