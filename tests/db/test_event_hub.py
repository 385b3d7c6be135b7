"""The event hub closes even when a change wakes its pump at the moment close() cancels it.

On CI an app's shutdown waited forever: on Python 3.11 ``asyncio.wait_for`` returns normally when
the awaitable it wraps completes just as its task is cancelled, so the pump swallowed close()'s one
cancellation and went on polling. Here a wake lands a few event-loop turns before close(), once for
each number of turns, so one of them meets the pump between its wake and its next step.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from kvroute.control.events import EventHub
from kvroute.store.engine import SessionMaker

CLOSE_BOUND_S = 5.0  # the hub polls every 60 s here, so a swallowed cancel cannot end in time
TURNS = range(8)


async def test_close_ends_the_hub_whenever_a_wake_lands(sessionmaker: SessionMaker) -> None:
    for turns in TURNS:
        hub = EventHub(
            sessionmaker,
            clock=lambda: datetime.now(UTC),
            poll_seconds=60.0,
            expiry_seconds=60.0,
        )
        hub.start()
        await asyncio.sleep(0.01)  # the pump is waiting for a wake
        hub._wake.set()  # what a committed change does (poke)
        for _ in range(turns):
            await asyncio.sleep(0)
        # Not asyncio.timeout: its cancel would reach the pump through close()'s await and end it.
        closing = asyncio.create_task(hub.close())
        done, _ = await asyncio.wait({closing}, timeout=CLOSE_BOUND_S)
        assert closing in done, f"close() still waiting after a wake {turns} turns before it"
        assert hub._tasks == []
