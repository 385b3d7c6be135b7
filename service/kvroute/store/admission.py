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
   (instance, rank) order: see ``geometry.classes``; found by index probes per class, not by
   reading the role's ranks); parsed registrations come from the
   process-wide cache by generation, so only documents never seen before are read and parsed;
4. checks the candidates in order, each against the members of its instance and the class
   representatives of the opposite role as the candidates admitted before it left them (exactly
   the answers admitting them one by one would give), verdicts memoized per class pair;
5. writes the admitted ones and their events with a fixed number of statements (``rank_writes``;
   on PostgreSQL the events travel in the storing statement).

A candidate that replaces a live rank with a document of another class ends the batch after it:
that class's next member was never read, so later candidates could not be checked against it.
The deferred candidates come back to the caller, which admits them in a new batch.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import BindParameter, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.geometry import GeometryError, RankRegistration, Role
from kvroute.geometry.checks.classes import VerdictMemo, check_peers_by_class
from kvroute.geometry.checks.instance import InstanceMemo, check_instance
from kvroute.geometry.checks.validate import check_self
from kvroute.store import engine_leases, events
from kvroute.store import ranks as repo
from kvroute.store.dialect import POSTGRES, Dialect, dialect_of
from kvroute.store.engine import (
    READ_ONLY,
    SessionMaker,
    engine_of,
    reader_engine,
    retry_disconnect,
)
from kvroute.store.engine_leases import LeaseTerms
from kvroute.store.errors import LeaseExpired
from kvroute.store.models import DeploymentRow, EngineLeaseRow, RankRow, UTCDateTime
from kvroute.store.peers import Peers, read_peers
from kvroute.store.rank_writes import Existing, write_admitted
from kvroute.store.records import RegisterOutcome
from kvroute.store.registrations import RegistrationCache

RANKS = RankRow.__table__
LEASES = EngineLeaseRow.__table__
# Admission fences what it judged expired, ranks and engine leases alike: never renewed again.
FENCED = (
    (RANKS, RANKS.c.lease_expires_at, "ranks_fenced"),
    (LEASES, LEASES.c.expires_at, "leases_fenced"),
)
DEPLOYMENTS = DeploymentRow.__table__
# A registration naming an engine lease that is not live is answered ``LeaseExpired``.
Outcome = RegisterOutcome | GeometryError | LeaseExpired


@dataclass
class BatchResult:
    """Outcomes of the candidates admitted or refused, in order; ``deferred`` were not looked at."""

    outcomes: list[Outcome] = field(default_factory=list)
    deferred: list[RankRegistration] = field(default_factory=list)


async def prepare(reg: RankRegistration) -> None:
    """What needs no lock: the document's own checks (raises) and its digests, off the loop
    (milliseconds for the largest documents)."""
    await asyncio.to_thread(_check_and_digest, reg)


def _check_and_digest(reg: RankRegistration) -> None:
    check_self(reg)
    _ = reg.class_digest, reg.canonical_digest, reg.instance_digest


class Caches(Protocol):
    """What admission keeps between calls besides the database (the ``Registry`` holds them): the
    parsed registrations, the verdicts per pair of classes and the instance digests that agreed."""

    registrations: RegistrationCache
    verdicts: VerdictMemo
    agreements: InstanceMemo


async def admit_batch(
    sessionmaker: SessionMaker,
    candidates: Sequence[RankRegistration],
    caches: Caches,
    *,
    now: datetime,
    leases: Sequence[str | None] | None = None,
) -> BatchResult:
    """Admits, renews or refuses ``candidates`` (one deployment, distinct ranks, self-checked);
    ``leases`` names each candidate's engine lease (None: a lease of its own)."""
    named = list(leases) if leases is not None else [None] * len(candidates)

    async def attempt() -> BatchResult:
        async with engine_of(sessionmaker).begin() as connection:
            return await _admit(connection, candidates, named, now, caches)

    result = await retry_disconnect(attempt)
    for reg, outcome in zip(candidates, result.outcomes, strict=False):
        if isinstance(outcome, RegisterOutcome):
            caches.registrations.remember(reg, outcome.generation)
    return result


async def _admit(
    connection: AsyncConnection,
    candidates: Sequence[RankRegistration],
    leases: Sequence[str | None],
    now: datetime,
    caches: Caches,
) -> BatchResult:
    deployment = candidates[0].deployment
    await repo.lock_deployment_connection(connection, deployment)
    at = await _open(connection, deployment, now)
    live = await engine_leases.live_terms(
        connection, deployment, {lease for lease in leases if lease is not None}, at
    )
    peers = await read_peers(connection, candidates, at)
    state = await _State.load(connection, caches.registrations, deployment, peers, at)
    outcomes: list[Outcome | None] = []
    admitted: list[tuple[int, RankRegistration, Existing | None]] = []
    terms: list[LeaseTerms] = []
    deferred: list[RankRegistration] = []
    for index, (reg, lease) in enumerate(zip(candidates, leases, strict=True)):
        if lease is not None and lease not in live:
            outcomes.append(engine_leases.missing(deployment, lease))
            continue
        try:
            state.check(reg, caches.verdicts, caches.agreements)
        except GeometryError as error:
            outcomes.append(error)
            continue
        old = peers.rows.get(reg.key)
        admitted.append((len(outcomes), reg, Existing(old[0], old[1]) if old else None))
        terms.append(live[lease] if lease is not None else engine_leases.own_terms(reg, at))
        outcomes.append(None)  # filled in once written
        if state.admit(reg, old, at):
            deferred = list(candidates[index + 1 :])
            break
    if not admitted:  # a refusal changes nothing: not checked_at, no fence, no deployment row
        await connection.rollback()
        return BatchResult([outcome for outcome in outcomes if outcome is not None], deferred)
    stored = await write_admitted(
        connection,
        [(reg, old) for _, reg, old in admitted],
        at,
        terms,
        _registered([reg for _, reg, _ in admitted], peers, at),
    )
    for (position, _, _), outcome in zip(admitted, stored, strict=True):
        outcomes[position] = outcome
    return BatchResult([outcome for outcome in outcomes if outcome is not None], deferred)


def _registered(
    admitted: Sequence[RankRegistration], peers: Peers, at: datetime
) -> list[events.Change]:
    """Events of the admissions a reader sees: a new rank, a new generation (a document other
    than the stored one: its generation is counted by the write, so it is None here), or a rank
    live again (a renewal of a live rank with the same document changes nothing it sees)."""
    news: list[tuple[str, int, int | None]] = []
    for reg in admitted:
        old = peers.rows.get(reg.key)
        if old is None or old[1] != reg.canonical_digest:
            news.append((reg.instance, reg.rank, None))
        elif old[3] <= at:
            news.append((reg.instance, reg.rank, old[0]))
    return events.rank_changes("rank_registered", news)


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
        peers: Peers,
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

    def check(self, reg: RankRegistration, verdicts: VerdictMemo, agreed: InstanceMemo) -> None:
        instance = self.members.get(reg.instance, {})
        others = [member for rank, member in instance.items() if rank != reg.rank]
        check_instance(reg, others, agreed)
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
    caches: Caches,
    *,
    now: datetime,
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
                peers = await read_peers(connection, candidates, at)
                state = await _State.load(
                    connection, caches.registrations, candidates[0].deployment, peers, at
                )
                for index, reg in enumerate(candidates):
                    try:
                        state.check(reg, caches.verdicts, caches.agreements)
                    except GeometryError as error:
                        return index, error
                    state.admit(reg, peers.rows.get(reg.key), at)
        return len(candidates), None

    return await retry_disconnect(attempt)


async def _checked_at(connection: AsyncConnection, deployment: str, now: datetime) -> datetime:
    """``max(now, checked_at)`` as ``_judging`` would set it, without writing it."""
    table = DeploymentRow.__table__
    stored = await connection.scalar(select(table.c.checked_at).where(table.c.name == deployment))
    return now if stored is None or stored < now else stored


async def _open(connection: AsyncConnection, deployment: str, now: datetime) -> datetime:
    """Steps 1 and 2 (see the module); returns ``at``. One statement where the dialect runs
    data-modifying CTEs (PostgreSQL), else one statement per step."""
    dialect = dialect_of(connection)
    values = {"key_deployment": deployment, "now": now}
    if dialect.arrays:
        return (await connection.execute(_opening_statement(), values)).scalar_one()
    judging, *fences = _opening_steps(dialect)
    at = (await connection.execute(judging, values)).scalar_one()
    for fence in fences:
        await connection.execute(fence, {"key_deployment": deployment, "at": at})
    return at


def _fence(table: Any, expiry: Any, deployment: Any, at: Any) -> Any:
    """``table``'s rows of ``deployment`` whose lease ended by ``at``, fenced at ``at``."""
    return (
        update(table)
        .where(table.c.deployment == deployment, expiry <= at, table.c.fenced_at.is_(None))
        .values(fenced_at=at)
    )


@functools.cache
def _opening_steps(dialect: Dialect) -> tuple[Any, ...]:
    """Elsewhere (SQLite): ``_judging`` (parameters ``key_deployment`` and ``now``), then each
    fence (``key_deployment`` and ``at``), built once: building them per batch cost more of the
    event loop than running them."""
    deployment: BindParameter[str] = bindparam("key_deployment")
    judging = _judging(dialect, deployment, bindparam("now", type_=UTCDateTime()))
    at = bindparam("at", type_=UTCDateTime())
    return judging, *(_fence(table, expiry, deployment, at) for table, expiry, _ in FENCED)


@functools.cache
def _opening_statement() -> Any:
    """PostgreSQL: ``checked_at`` moved (the deployment created if needed) and the fences set, as
    CTEs of one statement. Each fence still waits for a renewal committing on its row and then
    judges the renewed row (READ COMMITTED re-checks an updated row), as a statement of its own
    would; ``read_peers`` comes after it, in a statement of its own, and sees those renewals."""
    # "deployment" would also set that column
    deployment: BindParameter[str] = bindparam("key_deployment")
    now = bindparam("now", type_=UTCDateTime())
    judged = _judging(POSTGRES, deployment, now).cte("judged")
    at = select(judged.c.checked_at).scalar_subquery()
    fences = (_fence(table, expiry, deployment, at).cte(name) for table, expiry, name in FENCED)
    return select(judged.c.checked_at).add_cte(*fences)


def _judging(dialect: Dialect, deployment: Any, now: Any) -> Any:
    """Creates the deployment or moves its ``checked_at`` forward to ``max(now, checked_at)``;
    returns it."""
    opened = dialect.insert(DEPLOYMENTS).values(name=deployment, created_at=now, checked_at=now)
    newest = dialect.greatest(DEPLOYMENTS.c.checked_at, opened.excluded.checked_at)
    return opened.on_conflict_do_update(
        index_elements=[DEPLOYMENTS.c.name], set_={"checked_at": newest}
    ).returning(DEPLOYMENTS.c.checked_at)
