"""``Waves``: calls arriving while a wave runs form the next one; failures stay in their wave."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.control.waves import Waves

WAIT_S = 10.0


async def test_calls_arriving_during_a_wave_wait_for_the_next_one() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    seen: list[list[int]] = []

    async def run(key: str, items: list[int]) -> list[int]:
        seen.append(items)
        started.set()
        await release.wait()
        return [item * 10 for item in items]

    waves: Waves[int, int] = Waves(run, name="test")
    async with asyncio.timeout(WAIT_S):
        first = asyncio.ensure_future(waves.submit("k", 1))
        await started.wait()
        later = [asyncio.ensure_future(waves.submit("k", item)) for item in (2, 3)]
        other_key = asyncio.ensure_future(waves.submit("j", 4))
        release.set()
        assert await first == 10
        assert await asyncio.gather(*later) == [20, 30]
        assert await other_key == 40
    assert sorted(seen) == [[1], [2, 3], [4]]


async def test_a_failed_wave_fails_only_its_own_calls() -> None:
    calls = 0

    async def run(key: str, items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("database gone")
        return items

    waves: Waves[int, int] = Waves(run, name="test", max_wave=2)
    answers = await asyncio.gather(
        *(waves.submit("k", i) for i in range(3)), return_exceptions=True
    )
    assert [type(answer) for answer in answers[:2]] == [RuntimeError, RuntimeError]
    assert answers[2] == 2


async def test_a_cancelled_caller_leaves_its_wave_answered() -> None:
    release = asyncio.Event()

    async def run(key: str, items: list[int]) -> list[int]:
        await release.wait()
        return items

    waves: Waves[int, int] = Waves(run, name="test")
    gone = asyncio.ensure_future(waves.submit("k", 1))
    kept = asyncio.ensure_future(waves.submit("k", 2))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    async with asyncio.timeout(WAIT_S):
        assert await kept == 2
    with pytest.raises(asyncio.CancelledError):
        await gone
