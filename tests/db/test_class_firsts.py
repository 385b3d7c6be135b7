"""Admission's class representatives: the first live rank of each geometry class, by index probes.

``store.peers`` finds, per geometry class of the role a candidate checks against, the first live
rank in (instance, rank) order without reading the role's ranks. Against the rows themselves
(ordered here the same way), with expired ranks at the front of a class, a class whose every
rank expired, and the candidate's own instance read in full.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from kvroute.geometry import Role
from kvroute.store.engine import SessionMaker, engine_of
from kvroute.store.models import RankRow
from kvroute.store.peers import read_peers
from tests.db.documents import T0, register, registration

RANKS = RankRow.__table__
# (instance, rank) whose leases have ended when the batch reads: the first ranks of ctx0 and ctx4,
# all of ctx1, and ctx3's only rank (TP1: a class of its own), so that class has no live member.
EXPIRED = {("ctx0", 0), ("ctx1", 0), ("ctx1", 1), ("ctx3", 0), ("ctx4", 0)}


async def test_each_class_answers_its_first_live_rank(sessionmaker: SessionMaker) -> None:
    for instance in ("ctx2", "ctx1", "ctx0"):  # registered out of order
        for rank in (1, 0):
            reg = registration("d", instance, rank, role="context", tp_size=2)
            await register(sessionmaker, reg, now=T0)
    lone = registration("d", "ctx3", 0, role="context", tp_size=1)  # a class of its own
    await register(sessionmaker, lone, now=T0)
    for rank in (0, 1):  # TP4: another class
        await register(
            sessionmaker, registration("d", "ctx4", rank, role="context", tp_size=4), now=T0
        )
    own = registration("d", "gen0", 0, role="generation", tp_size=2)
    await register(sessionmaker, own, now=T0)
    at = T0 + timedelta(seconds=10)
    async with engine_of(sessionmaker).begin() as connection:
        for instance, rank in EXPIRED:
            await connection.execute(
                update(RANKS)
                .where(RANKS.c.instance == instance, RANKS.c.rank == rank)
                .values(lease_expires_at=at - timedelta(seconds=1))
            )
        rows = (
            await connection.execute(
                select(
                    RANKS.c.instance,
                    RANKS.c.rank,
                    RANKS.c.generation,
                    RANKS.c.geometry_class,
                    RANKS.c.lease_expires_at,
                )
                .where(RANKS.c.deployment == "d", RANKS.c.role == "context")
                .order_by(RANKS.c.instance, RANKS.c.rank)
            )
        ).all()
        peers = await read_peers(connection, [own], at)
    expected: dict[str, tuple[str, int, int]] = {}
    for instance, rank, generation, geometry, expires in rows:
        if expires > at:
            expected.setdefault(geometry, (instance, rank, generation))
    classes = {geometry for *_, geometry, _ in rows}
    assert len(classes) - len(expected) == 1  # TP1's only rank expired
    assert len(expected) >= 2
    assert peers.firsts == {Role.CONTEXT: expected}
    assert ("ctx0", 1, 1) in expected.values()  # ctx0 rank 0 expired: its class moves on
    assert set(peers.rows) == {("gen0", 0)}
