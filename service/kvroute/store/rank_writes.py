"""Writing admitted ranks: a whole batch of admissions in a fixed number of statements.

The caller holds the deployment lock and has checked every rank. Each write's rule is stated once
(the generation counted up, the instance created or re-stated, the rows inserted); the dialect
(``store.dialect``) says how its rows travel. Where rows travel as arrays (PostgreSQL) the new
documents of a batch (generation counters, instance rows, rank rows, their documents, pools and
views) and the batch's events (``events.appending_ctes``) are one statement of data-modifying CTEs
over ``unnest``ed arrays (``bulk``): one round trip, one prepared text whatever the batch size.
Elsewhere (SQLite, where statements cost no round trip) each write is one ``executemany``. Either way a batch of sixteen admissions costs the statements of one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    and_,
    bindparam,
    delete,
    insert,
    literal,
    select,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.geometry import RankRegistration
from kvroute.store import bulk, events
from kvroute.store import ranks as repo
from kvroute.store.dialect import POSTGRES, Dialect, dialect_of
from kvroute.store.engine_leases import LeaseTerms, own_terms
from kvroute.store.models import (
    Generation,
    InstanceRow,
    PoolRow,
    RankDocumentRow,
    RankRow,
    ViewRow,
)
from kvroute.store.records import RegisterOutcome

RANKS = RankRow.__table__
DOCUMENTS = RankDocumentRow.__table__
INSTANCES = InstanceRow.__table__
GENERATIONS = Generation.__table__
POOLS = PoolRow.__table__
VIEWS = ViewRow.__table__
KEY = ("deployment", "instance", "rank")
LAYOUT = ("role", "tp_size", "pp_size", "cp_size", "attention_dp", "dp_size")
RANK_VALUES = (
    "role",
    "lease_seconds",
    "lease_expires_at",
    "engine_lease",
    "registered_at",
    "canonical_sha256",
    "geometry_class",
    "fenced_at",
)


# A live rank registered again with the same document: its lease renewed, nothing else changes.
RENEWING = repo.rank_update(
    lease_expires_at=bindparam("expires"),
    lease_seconds=bindparam("seconds"),
    engine_lease=bindparam("lease"),
    fenced_at=None,
)


@dataclass(frozen=True, slots=True)
class Existing:
    """A candidate's own row before the batch: its generation and canonical digest."""

    generation: int
    canonical_sha256: str


async def write_admitted(
    connection: AsyncConnection,
    admitted: Sequence[tuple[RankRegistration, Existing | None]],
    at: datetime,
    terms: Sequence[LeaseTerms] | None = None,
    changes: Sequence[events.Change] = (),
) -> list[RegisterOutcome]:
    """Stores checked ranks (in order) under their lease terms (default: each its own lease from
    ``at``); an identical document only renews its lease (and attaches it to the engine lease it
    names, or detaches it). Appends ``changes`` to the deployment's event log (the deployment row
    exists): a change of a rank stored with a new document and without a generation gets the one
    counted here."""
    if terms is None:
        terms = [own_terms(reg, at) for reg, _ in admitted]
    renewed = [
        old is not None and old.canonical_sha256 == reg.canonical_digest for reg, old in admitted
    ]
    changed = [
        (reg, old, term)
        for (reg, old), term, same in zip(admitted, terms, renewed, strict=True)
        if not same
    ]
    await _renew(
        connection,
        [
            (reg, term)
            for (reg, _), term, same in zip(admitted, terms, renewed, strict=True)
            if same
        ],
    )
    generations: dict[tuple[str, int], int] = {}
    if changed:
        await _delete_replaced(connection, [reg for reg, old, _ in changed if old is not None])
        generations, appended = await _store(connection, changed, at, changes)
        if appended:
            changes = ()
    if changes:
        deployment = admitted[0][0].deployment
        await events.append(connection, deployment, _numbered(changes, generations), at)
    outcomes = []
    for (reg, old), term, same in zip(admitted, terms, renewed, strict=True):
        generation = old.generation if same and old else generations[reg.key]
        outcomes.append(RegisterOutcome(generation, term.expires_at, created=old is None))
    return outcomes


async def _renew(
    connection: AsyncConnection, renewals: Sequence[tuple[RankRegistration, LeaseTerms]]
) -> None:
    if not renewals:
        return
    await connection.execute(
        RENEWING,
        [
            {
                **_key(reg, "key_"),
                "expires": term.expires_at,
                "seconds": term.lease_seconds,
                "lease": term.engine_lease,
            }
            for reg, term in renewals
        ],
    )


def _numbered(
    changes: Sequence[events.Change], generations: dict[tuple[str, int], int]
) -> list[events.Change]:
    """``changes`` with the generations counted by ``_store`` where they had none (the rule the
    storing statement applies when it appends them itself)."""
    numbered = []
    for change in changes:
        counted = None
        if change.generation is None and change.instance is not None and change.rank is not None:
            counted = generations.get((change.instance, change.rank))
        numbered.append(change if counted is None else replace(change, generation=counted))
    return numbered


async def _store(
    connection: AsyncConnection,
    changed: Sequence[tuple[RankRegistration, Existing | None, LeaseTerms]],
    at: datetime,
    changes: Sequence[events.Change],
) -> tuple[dict[tuple[str, int], int], bool]:
    """Stores the new documents (their old rows already deleted); returns their generations, and
    whether ``changes`` were appended too (in the same statement, where rows travel as arrays)."""
    documents = {reg.key: reg.to_json() for reg, _, _ in changed}
    ranks = [{**_key(reg), **_rank_values(reg, term, at)} for reg, _, term in changed]
    stored = [{**_key(reg), "document": documents[reg.key]} for reg, _, _ in changed]
    pools = [
        repo.pool_row(_key(reg), pool)
        for reg, _, _ in changed
        for pool in documents[reg.key]["pools"]
    ]
    views = [
        repo.view_row(_key(reg), view)
        for reg, _, _ in changed
        for view in documents[reg.key]["views"]
    ]
    regs = [reg for reg, _, _ in changed]
    instances = _instance_rows(regs, at)
    dialect = dialect_of(connection)
    if dialect.arrays:
        generations = await _store_in_one_statement(
            connection, regs, instances, ranks, (stored, pools, views), changes, at
        )
        return generations, True
    counter, restating, inserts = _row_writes(dialect)
    generations = await _next_generations(connection, counter, regs)
    await connection.execute(restating, instances)
    for row in ranks:
        row["generation"] = generations[row["instance"], row["rank"]]
    for statement, rows in zip(inserts, (ranks, stored, pools, views), strict=True):
        if rows:
            await connection.execute(statement, rows)
    return generations, False


@functools.cache
def _row_writes(dialect: Dialect) -> tuple[Any, Any, tuple[Any, ...]]:
    """Where rows go as ``executemany`` (SQLite): the generation counter, the instances' upsert
    and the inserts of ranks, documents, pools and views, built once (built per batch, they cost
    the event loop more than running them)."""
    counter = _counted(dialect.insert(GENERATIONS))
    inserts = tuple(insert(table) for table in (RANKS, DOCUMENTS, POOLS, VIEWS))
    return counter, _restated(dialect.insert(INSTANCES)), inserts


async def _store_in_one_statement(
    connection: AsyncConnection,
    regs: Sequence[RankRegistration],
    instances: Sequence[dict[str, Any]],
    ranks: Sequence[dict[str, Any]],
    parts: tuple[Sequence[dict[str, Any]], ...],
    changes: Sequence[events.Change],
    at: datetime,
) -> dict[tuple[str, int], int]:
    """``parts``: the ranks' documents, pools and views; ``changes`` are appended in the same
    statement."""
    stored, pools, views = parts
    values = {
        **bulk.arrays(GENERATIONS, [_key(reg) for reg in regs], KEY, "counted"),
        **bulk.arrays(INSTANCES, instances, INSTANCE_COLUMNS, "instance_rows"),
        **bulk.arrays(RANKS, ranks, RANK_COLUMNS, "rank_rows"),
        **bulk.arrays(DOCUMENTS, stored, DOCUMENT_COLUMNS, "document_rows"),
        **bulk.arrays(POOLS, pools, POOL_COLUMNS, "pool_rows"),
        **bulk.arrays(VIEWS, views, VIEW_COLUMNS, "view_rows"),
    }
    if changes:
        values.update(events.appending_values(regs[0].deployment, changes, at))
    rows = await connection.execute(_storing_statement(appending=bool(changes)), values)
    return {(instance, rank): generation for instance, rank, generation in rows}


INSTANCE_COLUMNS = ("deployment", "name", "created_at", *LAYOUT)
RANK_COLUMNS = (*KEY, *RANK_VALUES)
DOCUMENT_COLUMNS = (*KEY, "document")
POOL_COLUMNS = tuple(column.name for column in POOLS.c)
VIEW_COLUMNS = tuple(column.name for column in VIEWS.c)


@functools.cache
def _storing_statement(appending: bool = False) -> Any:
    """PostgreSQL: each rank's generation counted up (numbers are never reused, not even after a
    delete), its instance created or re-stated, its row, document, pools and views inserted, and
    with ``appending`` the batch's events appended (``events.appending_ctes``: one round trip
    fewer under the deployment lock); returns (instance, rank, generation) per rank. Built once
    per form: its text fits every batch size."""
    counted = bulk.unnest_rows(GENERATIONS, KEY, "counted")
    counter = POSTGRES.insert(GENERATIONS).from_select(
        [*KEY, "generation"], select(*counted.c, literal(1, BigInteger()))
    )
    following = _counted(counter).cte("following")
    instances = bulk.unnest_rows(INSTANCES, INSTANCE_COLUMNS, "instance_rows")
    restated = _restated(
        POSTGRES.insert(INSTANCES).from_select(
            INSTANCE_COLUMNS, select(*bulk.values(INSTANCES, instances, INSTANCE_COLUMNS))
        )
    )
    rows = bulk.unnest_rows(RANKS, RANK_COLUMNS, "rank_rows")
    ranks = bulk.values(RANKS, rows, RANK_COLUMNS)
    numbered = select(*ranks, following.c.generation).join_from(
        rows,
        following,
        and_(following.c.instance == rows.c.instance, following.c.rank == rows.c.rank),
    )
    writes = [
        restated.cte("instances_written"),
        insert(RANKS)
        .from_select([*KEY, *RANK_VALUES, "generation"], numbered)
        .cte("ranks_written"),
        bulk.insert_rows(DOCUMENTS, DOCUMENT_COLUMNS, "document_rows").cte("documents_written"),
        bulk.insert_rows(POOLS, POOL_COLUMNS, "pool_rows").cte("pools_written"),
        bulk.insert_rows(VIEWS, VIEW_COLUMNS, "view_rows").cte("views_written"),
    ]
    if appending:
        writes += events.appending_ctes(following)
    return select(following.c.instance, following.c.rank, following.c.generation).add_cte(*writes)


def _counted(counter: Any) -> Any:
    """The generation counter's rule: a rank's first generation is 1, each later one the last
    plus one (numbers are never reused, not even after a delete); returns the new numbers."""
    return counter.on_conflict_do_update(
        index_elements=[GENERATIONS.c[name] for name in KEY],
        set_={"generation": GENERATIONS.c.generation + 1},
    ).returning(GENERATIONS.c.instance, GENERATIONS.c.rank, GENERATIONS.c.generation)


def _restated(instances: Any) -> Any:
    """An instance is created, or its layout re-stated (the checks agreed with every member)."""
    return instances.on_conflict_do_update(
        index_elements=[INSTANCES.c.deployment, INSTANCES.c.name],
        set_={name: instances.excluded[name] for name in LAYOUT},
    )


async def _next_generations(
    connection: AsyncConnection, counter: Any, regs: Sequence[RankRegistration]
) -> dict[tuple[str, int], int]:
    """Each rank's next generation, counted in one ``executemany`` of ``counter`` (``_counted``)."""
    if not regs:
        return {}
    rows = await connection.execute(counter, [{**_key(reg), "generation": 1} for reg in regs])
    return {(instance, rank): generation for instance, rank, generation in rows}


def _instance_rows(regs: Sequence[RankRegistration], at: datetime) -> list[dict[str, Any]]:
    """Creates the instances or re-states their layouts (the checks agreed with every member):
    one row per instance, the last of its ranks wins."""
    layouts = {reg.instance: _layout(reg) for reg in regs}
    return [
        {"deployment": regs[0].deployment, "name": name, "created_at": at, **layout}
        for name, layout in layouts.items()
    ]


async def _delete_replaced(
    connection: AsyncConnection, replaced: Sequence[RankRegistration]
) -> None:
    """Rows about to be written again; their documents, pools and views go with them (ON DELETE
    CASCADE)."""
    if replaced:
        keys = [(reg.deployment, reg.instance, reg.rank) for reg in replaced]
        await connection.execute(
            delete(RANKS).where(
                tuple_(RANKS.c.deployment, RANKS.c.instance, RANKS.c.rank).in_(keys)
            )
        )


def _rank_values(reg: RankRegistration, term: LeaseTerms, at: datetime) -> dict[str, Any]:
    return {
        "role": reg.role.value,
        "lease_seconds": term.lease_seconds,
        "lease_expires_at": term.expires_at,
        "engine_lease": term.engine_lease,
        "registered_at": at,
        "canonical_sha256": reg.canonical_digest,
        "geometry_class": reg.class_digest,
        "fenced_at": None,
    }


def _layout(reg: RankRegistration) -> dict[str, Any]:
    return {
        "role": reg.role.value,
        "tp_size": reg.tp_size,
        "pp_size": reg.pp_size,
        "cp_size": reg.cp_size,
        "attention_dp": reg.attention_dp,
        "dp_size": reg.dp_size,
    }


def _key(reg: RankRegistration, prefix: str = "") -> dict[str, Any]:
    return {
        f"{prefix}deployment": reg.deployment,
        f"{prefix}instance": reg.instance,
        f"{prefix}rank": reg.rank,
    }
