"""Issue 34: what each statement of one admission batch and one heartbeat wave costs the database,
at each fleet size, as ratios against the smallest: the term that grows with the fleet, if any.

Per size (``--sizes 1024,8192``) and database (``--configs postgres,sqlite``), a fresh database
gets scale_bench's fleet (random slot layouts, per-rank leases), admitted in-process 16 at a time.
Then, with every statement recorded as the driver receives it (text and parameters):

* a batch: 16 ranks of one new context instance, admitted as one ``admission.admit_batch``;
* a wave: 16 heartbeats of random ranks, renewed as one ``leases.renew_many`` (with
  ``--engine-leases``, where every 8 ranks are kept by an engine lease: 16 leases renewed as one
  ``engine_leases.renew_many``, and the probe batch's ranks name leases of their own).

Each recorded statement is run again inside a transaction that is rolled back (the batch's rows
deleted first, so its writes write again): on PostgreSQL under ``EXPLAIN (ANALYZE, BUFFERS)``
(planning and execution time, shared buffers touched), on SQLite timed and with ``EXPLAIN QUERY
PLAN`` (a ``SCAN`` of a table that grows with the fleet is such a term). A statement whose
execution or buffers grow with the fleet shows as a ratio well over 1.

    python bench/admission_explain.py [--sizes 1024,8192] [--configs postgres,sqlite] [--repeat 5]
        [--engine-leases]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import delete, event
from sqlalchemy.ext.asyncio import AsyncEngine

import scale_bench
from kvroute.control.registry import Registry
from kvroute.geometry import RankRegistration
from kvroute.store import admission, engine_leases, leases, migrate, sqlite_driver
from kvroute.store.engine import autocommit_engine, create_engine, dispose, make_sessionmaker
from kvroute.store.models import Event, InstanceRow, RankRow
from tables import figures_table

CLIENTS = 16
PROBE_INSTANCE = "probe-ctx"
LEASE_RANKS = 8  # ranks per engine lease, as scale_bench grants them
Recorded = tuple[str, Any, bool]  # statement, parameters, executemany


class Cost:
    """One statement's replays: execution (and planning) ms, buffers, and SQLite's plan."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.executions: list[float] = []
        self.plannings: list[float] = []
        self.buffers = 0
        self.scans: list[str] = []  # SQLite: tables the plan scans whole

    @property
    def execution(self) -> float:
        return statistics.median(self.executions)


def label(statement: str) -> str:
    """A short name: a statement of CTEs by its first CTEs, else its first words."""
    text = " ".join(statement.split())
    names = re.findall(r"(\w+) AS \((?:INSERT|UPDATE|SELECT|DELETE)", text)
    if text.startswith("WITH") and names:
        more = f" +{len(names) - 3}" if len(names) > 3 else ""
        return "WITH " + ", ".join(names[:3]) + more
    return " ".join(text.split()[:5])[:60]


Fleet = tuple[AsyncEngine, Registry, list[Any], dict[tuple[str, int], str]]


async def admitted_fleet(url: str, size: int, engine_leases: bool) -> Fleet:
    """A fresh database holding scale_bench's fleet of ``size`` ranks, admitted in-process; with
    ``engine_leases``, each 8 ranks of an instance kept by a lease of theirs ((instance, rank //
    8) -> lease id)."""
    if url.startswith("postgresql"):
        await scale_bench.fresh_postgres(url)
    migrate.upgrade(url)
    engine = create_engine(url)
    registry = Registry(make_sessionmaker(engine), rejection_log_size=100)
    ranks = scale_bench.fleet(size // 32)
    kept = await _leases(registry, [(name, reg.rank) for name, reg in ranks], engine_leases)
    queue = [_registration(name, reg) for name, reg in ranks]

    async def client() -> None:
        while queue:
            reg = queue.pop()
            lease = kept.get((reg.instance, reg.rank // LEASE_RANKS))
            await registry.register(reg, now=datetime.now(UTC), engine_lease=lease)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    await registry.refresh_statistics()  # as the server's reaper round does (store.statistics)
    return engine, registry, ranks, kept


async def _leases(
    registry: Registry, ranks: list[tuple[str, int]], wanted: bool
) -> dict[tuple[str, int], str]:
    """An engine lease per 8 ranks of each instance, when ``wanted``."""
    groups = sorted({(name, rank // LEASE_RANKS) for name, rank in ranks}) if wanted else []
    now = datetime.now(UTC)
    return {
        group: (await registry.grant_lease("fleet", 3600, now=now)).lease_id for group in groups
    }


def _registration(name: str, reg: RankRegistration) -> RankRegistration:
    doc = scale_bench._document(reg, name, "random", 9)
    return RankRegistration.from_json(doc, deployment="fleet", instance=name, rank=reg.rank)


@contextmanager
def recording(*engines: AsyncEngine) -> Iterator[list[Recorded]]:
    """Every statement the engines' drivers receive while the block runs."""
    seen: list[Recorded] = []

    def before(_c: Any, _cur: Any, statement: str, parameters: Any, _ctx: Any, many: bool) -> None:
        if many and parameters and not isinstance(parameters[0], tuple | list | dict):
            many = False  # "insertmanyvalues": the rows in one statement, one flat parameter tuple
        seen.append((statement, list(parameters) if many else parameters, many))

    # SQLite's heartbeat wave runs on aiosqlite's own calls (store.sqlite_driver), not SQLAlchemy.
    driven = sqlite_driver.Wave._call

    async def call(wave: Any, method: Any, statement: str, parameters: Any) -> Any:
        many = method.__name__ == "executemany"
        seen.append((statement, [*map(tuple, parameters)] if many else tuple(parameters), many))
        return await driven(wave, method, statement, parameters)

    for engine in engines:
        event.listen(engine.sync_engine, "before_cursor_execute", before)
    sqlite_driver.Wave._call = call  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        sqlite_driver.Wave._call = driven  # type: ignore[method-assign]
        for engine in engines:
            event.remove(engine.sync_engine, "before_cursor_execute", before)


async def probe_statements(fleet: Fleet) -> dict[str, list[Recorded]]:
    """The statements of one admission batch of 16 new ranks and of one wave of 16 heartbeats
    (of engine-lease renewals, where the fleet's ranks are kept by engine leases)."""
    engine, registry, ranks, kept = fleet
    context = [_registration(PROBE_INSTANCE, reg) for name, reg in ranks if name == "ctx0"]
    probe = await _leases(registry, [(reg.instance, reg.rank) for reg in context], bool(kept))
    for reg in context:
        admission._check_and_digest(reg)
    named = [probe.get((reg.instance, reg.rank // LEASE_RANKS)) for reg in context]
    with recording(engine) as batch:
        result = await admission.admit_batch(
            registry.sessionmaker, context, registry, now=datetime.now(UTC), leases=named
        )
    assert len(result.outcomes) == len(context), "the probe batch was not admitted whole"
    with recording(engine, autocommit_engine(engine)) as wave:
        if kept:
            picked = random.Random(7).sample(sorted(kept.values()), CLIENTS)
            now = datetime.now(UTC)
            renewed = await engine_leases.renew_many(engine, "fleet", [(p, now) for p in picked])
        else:
            chosen = random.Random(7).sample(ranks, CLIENTS)
            now = datetime.now(UTC)
            renewals = [(name, reg.rank, now) for name, reg in chosen]
            renewed = await leases.renew_many(engine, "fleet", renewals)
    assert len(renewed) == CLIENTS, "the probe wave did not renew every lease"
    return {"admission batch": batch, "renewal wave": wave}


async def replay(engine: AsyncEngine, recorded: list[Recorded], repeat: int) -> list[Cost]:
    """Each statement run again ``repeat`` times, each time in a transaction rolled back."""
    costs = [Cost(label(statement)) for statement, _, _ in recorded]
    postgres = engine.dialect.name == "postgresql"
    for _ in range(repeat):
        async with engine.connect() as connection:
            transaction = await connection.begin()
            # The batch's rows, so its writes write again (SQLite numbers events in Python).
            for column in (RankRow.instance, InstanceRow.name, Event.instance):
                await connection.execute(delete(column.class_).where(column == PROBE_INSTANCE))
            for cost, (statement, parameters, many) in zip(costs, recorded, strict=True):
                run = _explained if postgres else _timed
                await run(connection, cost, statement, parameters, many)
            await transaction.rollback()
    return costs


async def _explained(
    connection: Any, cost: Cost, statement: str, parameters: Any, many: bool
) -> None:
    rows = parameters if many else [parameters]
    execution = planning = 0.0
    buffers = 0
    for row in rows:
        explain = f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}"
        found = (await connection.exec_driver_sql(explain, row)).scalar_one()
        [plan] = json.loads(found) if isinstance(found, str) else found  # asyncpg decodes JSON
        execution += plan["Execution Time"]
        planning += plan.get("Planning Time", 0.0)
        top = plan["Plan"]
        buffers += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
    cost.executions.append(execution)
    cost.plannings.append(planning)
    cost.buffers = buffers


async def _timed(connection: Any, cost: Cost, statement: str, parameters: Any, many: bool) -> None:
    if not cost.scans and not statement.lstrip().upper().startswith("BEGIN"):
        first = parameters[0] if many else parameters
        plan = await connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", first)
        scanned = {m for (*_, detail) in plan for m in re.findall(r"SCAN (\w+)", detail)}
        cost.scans = sorted(scanned & set(RankRow.metadata.tables))  # not CTEs, not constants
    started = time.perf_counter()
    if not statement.lstrip().upper().startswith("BEGIN"):
        await connection.exec_driver_sql(statement, parameters)
    cost.executions.append((time.perf_counter() - started) * 1e3)


async def measure(url: str, size: int, args: argparse.Namespace) -> dict[str, list[Cost]]:
    fleet = await admitted_fleet(url, size, args.engine_leases)
    engine = fleet[0]
    try:
        recorded = await probe_statements(fleet)
        return {name: await replay(engine, found, args.repeat) for name, found in recorded.items()}
    finally:
        await dispose(engine)


def report(config: str, sizes: list[int], runs: list[dict[str, list[Cost]]]) -> None:
    console = Console(width=170)
    postgres = config == "postgres"
    for unit in runs[0]:
        per_size = [run[unit] for run in runs]
        labels = [cost.label for cost in per_size[0]]
        if any([cost.label for cost in costs] != labels for costs in per_size):
            raise AssertionError(f"{unit}: the sizes ran different statements")
        figures = [f"{size:,}: exec ms" for size in sizes]
        figures += [f"{size:,}: buffers" for size in sizes] if postgres else ["scans"]
        figures += [f"{sizes[-1]:,}: planning ms"] if postgres else []
        figures += [f"{sizes[-1]:,} / {sizes[0]:,}"]
        table = figures_table(f"{config}: {unit}, per statement", ["statement"], figures)
        for index, name in enumerate(labels):
            costs = [costs[index] for costs in per_size]
            row = [name, *(f"{cost.execution:.3f}" for cost in costs)]
            if postgres:
                row += [str(cost.buffers) for cost in costs]
                row.append(f"{statistics.median(costs[-1].plannings):.3f}")
            else:
                row.append(", ".join(costs[-1].scans) or "-")
            first, last = costs[0].execution, costs[-1].execution
            row.append(_ratio(last, first))
            table.add_row(*row)
        totals = [sum(cost.execution for cost in costs) for costs in per_size]
        blank = [""] * (len(sizes) + 1 if postgres else 1)
        table.add_row(
            "all", *(f"{total:.3f}" for total in totals), *blank, _ratio(totals[-1], totals[0])
        )
        console.print(table)


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline > 0.005 else "-"  # not for what took no time


async def main(args: argparse.Namespace) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    for config in args.configs.split(","):
        runs = []
        for size in sizes:
            with tempfile.TemporaryDirectory() as directory:
                url = (
                    scale_bench.POSTGRES_URL
                    if config == "postgres"
                    else f"sqlite+aiosqlite:///{Path(directory) / 'explain.db'}"
                )
                runs.append(await measure(url, size, args))
        report(config, sizes, runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,8192")
    parser.add_argument("--configs", default="postgres,sqlite")
    parser.add_argument("--repeat", type=int, default=5, help="replays per statement (median)")
    parser.add_argument(
        "--engine-leases", action="store_true", help="ranks kept by engine leases of 8 ranks"
    )
    asyncio.run(main(parser.parse_args()))
