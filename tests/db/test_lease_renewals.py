"""Engine-lease renewals in waves: concurrent renewals share one statement (on SQLite, one write
transaction), each judged at its own clock reading as if alone."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from kvroute.control import renewals
from kvroute.control.registry import Registry
from kvroute.store import engine_leases
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import LeaseExpired
from kvroute.store.rejections import DEFAULT_LOG_SIZE
from tests.db.documents import T0, registration

LEASE = 10


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


@pytest.fixture
def waves(monkeypatch: pytest.MonkeyPatch) -> list[list[engine_leases.Renewal]]:
    """Every wave of lease renewals sent to the store."""
    sent: list[list[engine_leases.Renewal]] = []
    real = engine_leases.renew_many

    async def recorded(
        engine: object, deployment: str, wave: list[engine_leases.Renewal]
    ) -> object:
        sent.append(list(wave))
        return await real(engine, deployment, wave)  # type: ignore[arg-type]

    monkeypatch.setattr(renewals.engine_leases, "renew_many", recorded)
    return sent


async def test_concurrent_lease_renewals_share_waves_each_at_its_own_clock(
    sessionmaker: SessionMaker, waves: list[list[engine_leases.Renewal]]
) -> None:
    registry = Registry(sessionmaker, rejection_log_size=DEFAULT_LOG_SIZE)
    leases = [(await registry.grant_lease("llama", LEASE, now=T0)).lease_id for _ in range(3)]
    for index, lease in enumerate(leases):  # instance ctx{i}: two ranks on lease i
        for rank in range(2):
            reg = registration("llama", f"ctx{index}", rank, tp_size=2, lease_seconds=LEASE)
            await registry.register(reg, now=T0, engine_lease=lease)
    await registry.renew_lease("llama", leases[2], now=T0 + seconds(1))
    waves.clear()
    # Lease 1 twice (its repeat waits a wave), lease 2 after it expired (T0 + 1 + 10), an unknown.
    calls = [
        (leases[0], 5),
        (leases[1], 6),
        ("no-such-lease", 6),
        (leases[2], 12),
        (leases[0], 7),
    ]
    answers = await asyncio.gather(
        *(registry.renew_lease("llama", lease, now=T0 + seconds(at)) for lease, at in calls),
        return_exceptions=True,
    )

    assert [len(wave) for wave in waves] == [4, 1]
    first, second, unknown, expired, again = answers
    assert first.lease_expires_at == T0 + seconds(5 + LEASE)
    assert first.ranks == (("ctx0", 0), ("ctx0", 1))
    assert second.lease_expires_at == T0 + seconds(6 + LEASE)
    assert second.ranks == (("ctx1", 0), ("ctx1", 1))
    assert isinstance(unknown, LeaseExpired)
    assert isinstance(expired, LeaseExpired)
    assert again.lease_expires_at == T0 + seconds(7 + LEASE)
    assert again.ranks == (("ctx0", 0), ("ctx0", 1))
    # Each lease row and its ranks hold what its last renewal answered.
    kept = await registry.lease("llama", leases[0])
    assert kept.lease_expires_at == T0 + seconds(7 + LEASE)
