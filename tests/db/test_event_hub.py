"""The event hub closes even when a change wakes its pump at the moment close() cancels it, and a
bounded watch ends after what the log held when it opened.

On CI an app's shutdown waited forever: on Python 3.11 ``asyncio.wait_for`` returns normally when
the awaitable it wraps completes just as its task is cancelled, so the pump swallowed close()'s one
cancellation and went on polling. Here a wake lands a few event-loop turns before close(), once for
each number of turns, so one of them meets the pump between its wake and its next step.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from kvroute.control.events import EventHub
from kvroute.store import events as event_log
from kvroute.store.engine import SessionMaker
from kvroute.store.models import DeploymentRow

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


async def test_a_bounded_watch_ends_after_what_the_log_held_at_opening(
    sessionmaker: SessionMaker,
) -> None:
    """``follow=False`` ends at the log's revision when opened, even when the feed (kept by a
    following watcher) has not read the newest events yet: the pump polls once a minute here, so
    only the wake of opening can bring them in time."""
    hub = EventHub(
        sessionmaker, clock=lambda: datetime.now(UTC), poll_seconds=60.0, expiry_seconds=60.0
    )
    hub.start()
    following = await hub.open("llama", None)
    try:
        now = datetime.now(UTC)
        async with sessionmaker.begin() as session:
            connection = await session.connection()
            await connection.execute(
                DeploymentRow.__table__.insert().values(
                    name="llama", created_at=now, checked_at=now
                )
            )
            changes = event_log.rank_changes("rank_registered", [("ctx0", 0, 1), ("ctx1", 0, 1)])
            assert await event_log.append(connection, "llama", changes, now) == 4
        bounded = await hub.open("llama", 1, follow=False)
        async with asyncio.timeout(CLOSE_BOUND_S):
            revisions = [event.revision async for event in bounded if event is not None]
        assert revisions == [2, 3, 4]
        assert (bounded.until, bounded.cursor) == (4, 4)
        bounded.close()
        nothing = await hub.open("llama", None, follow=False)  # from now: nothing to send
        assert [event async for event in nothing] == []
        nothing.close()
    finally:
        following.close()
        await hub.close()
