"""Heartbeats in waves: concurrent renewals share one statement, each judged as if alone."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from kvroute.control import renewals
from kvroute.store import leases, registry
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import LeaseExpired, NotFound
from tests.db import documents
from tests.db.documents import T0, registration

LEASE = 10


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


async def register(sessionmaker: SessionMaker, instance: str, tp_size: int) -> None:
    for rank in range(tp_size):
        reg = registration("llama", instance, rank, tp_size=tp_size, lease_seconds=LEASE)
        await documents.register(sessionmaker, reg, now=T0)


@pytest.fixture
def waves(monkeypatch: pytest.MonkeyPatch) -> list[list[leases.Renewal]]:
    """Every wave ``Renewals`` sends to the store."""
    sent: list[list[leases.Renewal]] = []
    real = leases.renew_many

    async def recorded(engine: object, deployment: str, wave: list[leases.Renewal]) -> object:
        sent.append(list(wave))
        return await real(engine, deployment, wave)  # type: ignore[arg-type]

    monkeypatch.setattr(renewals.leases, "renew_many", recorded)
    return sent


async def test_concurrent_heartbeats_share_one_statement_each_at_its_own_clock(
    sessionmaker: SessionMaker, waves: list[list[leases.Renewal]]
) -> None:
    await register(sessionmaker, "ctx0", tp_size=8)
    service = renewals.Renewals(sessionmaker)

    expiries = await asyncio.gather(
        *(
            service.heartbeat("llama", "ctx0", rank, now=T0 + seconds(5 + rank / 2))
            for rank in range(8)
        )
    )

    assert [len(wave) for wave in waves] == [8]
    assert expiries == [T0 + seconds(5 + rank / 2 + LEASE) for rank in range(8)]
    # Past every original lease (T0 + 10), before every renewed one.
    state = await registry.get_instance(sessionmaker, "llama", "ctx0", now=T0 + seconds(LEASE + 3))
    assert [rank.state for rank in state.ranks] == ["live"] * 8  # the renewals were committed


async def test_a_rank_renewed_twice_at_once_is_judged_twice(
    sessionmaker: SessionMaker, waves: list[list[leases.Renewal]]
) -> None:
    await register(sessionmaker, "ctx0", tp_size=2)
    service = renewals.Renewals(sessionmaker)

    first, second, other = await asyncio.gather(
        service.heartbeat("llama", "ctx0", 0, now=T0 + seconds(1)),
        service.heartbeat("llama", "ctx0", 0, now=T0 + seconds(2)),
        service.heartbeat("llama", "ctx0", 1, now=T0 + seconds(3)),
    )

    # The repeat ends the first wave: it and everything behind it go to the next one.
    assert [[renewal[:2] for renewal in wave] for wave in waves] == [
        [("ctx0", 0)],
        [("ctx0", 0), ("ctx0", 1)],
    ]
    assert (first, second, other) == (T0 + seconds(11), T0 + seconds(12), T0 + seconds(13))


async def test_one_refused_renewal_does_not_refuse_its_wave(
    sessionmaker: SessionMaker, waves: list[list[leases.Renewal]]
) -> None:
    await register(sessionmaker, "ctx0", tp_size=2)
    renewed = await registry.heartbeat(sessionmaker, "llama", "ctx0", 1, now=T0 + seconds(9))
    assert renewed == T0 + seconds(19)
    waves.clear()
    service = renewals.Renewals(sessionmaker)
    late = T0 + seconds(LEASE + 1)  # rank 0's lease ended; rank 1's was renewed

    answers = await asyncio.gather(
        service.heartbeat("llama", "ctx0", 0, now=late),
        service.heartbeat("llama", "ctx0", 1, now=late),
        service.heartbeat("llama", "ctx0", 7, now=late),
        return_exceptions=True,
    )

    assert len(waves) == 1
    assert isinstance(answers[0], LeaseExpired)
    assert answers[1] == late + seconds(LEASE)
    assert type(answers[2]) is NotFound
