"""Watching a deployment: every replica's watchers share one reader of the event log.

``EventHub`` keeps, per watched deployment, the revision it has read up to and a window of recent
events. Whenever the log may have grown it reads what follows, once for all of its watchers, and
wakes them: after a write on this replica (``poke``), on PostgreSQL's ``NOTIFY kvroute_events`` from
any replica (one listening connection, reconnected with a catch-up read when it drops), and at
least every ``poll_seconds`` (SQLite's only cross-process signal; on PostgreSQL a safety net). A
watcher resuming from revision ``n`` is served from the window when it still holds ``n + 1``, else
from the log in bounded pages, then from the window as it grows; every event once, in revision
order. A revision older than the log keeps (``store.events.KEEP_PER_DEPLOYMENT``) is answered
``EventsCompacted``: the watcher must read the state again and watch from its revision.

The hub also appends ``rank_expired`` events (``note_expiries``) every ``expiry_seconds``: expiries
are the one change no request makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from kvroute import wire
from kvroute.store import events as log_store
from kvroute.store.engine import SessionMaker, engine_of
from kvroute.store.errors import StoreError

log = logging.getLogger(__name__)

PAGE = 1_000  # events per catch-up read
WINDOW = 4_096  # recent events a deployment's watchers are served from
KEEPALIVE_SECONDS = 15.0


class EventsCompacted(StoreError):
    """The revision to resume from is older than the log keeps."""

    code = "events_compacted"


@dataclass
class _Feed:
    revision: int  # read up to here
    window: list[wire.Event] = field(default_factory=list)  # contiguous revisions
    grown: asyncio.Condition = field(default_factory=asyncio.Condition)
    watchers: int = 0


class EventHub:
    def __init__(
        self,
        sessionmaker: SessionMaker,
        *,
        clock: Callable[[], datetime],
        poll_seconds: float = 1.0,
        expiry_seconds: float = 1.0,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.clock = clock
        self.poll_seconds = poll_seconds
        self.expiry_seconds = expiry_seconds
        self.keepalive_seconds = keepalive_seconds
        self._feeds: dict[str, _Feed] = {}
        self._starting: dict[str, asyncio.Future[int]] = {}
        self._wake = asyncio.Event()
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []

    # Lifecycle.

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._pump(), name="kvroute-events-pump"),
            asyncio.create_task(self._note_expiries(), name="kvroute-events-expiries"),
        ]
        engine = engine_of(self.sessionmaker)
        if log_store.notifies(engine):
            listening = log_store.listen(engine, self.poke, self._mark_all)
            self._tasks.append(asyncio.create_task(listening, name="kvroute-events-listen"))

    async def close(self) -> None:
        """Ends every watch (their streams close) and the hub's tasks."""
        self._closed = True
        for feed in self._feeds.values():
            async with feed.grown:
                feed.grown.notify_all()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def poke(self, deployment: str) -> None:
        """The log of ``deployment`` grew on this replica: read it now."""
        if deployment in self._feeds:
            self._wake.set()

    # Watching.

    async def open(self, deployment: str, since: int | None, *, follow: bool = True) -> Watch:
        """A watch of the events after revision ``since`` (default: from now on); raises
        ``EventsCompacted`` when the log no longer holds the event after ``since``. Unless it
        ``follow``s, the watch ends after the revision the log holds now."""
        feed = await self._feed(deployment)
        feed.watchers += 1
        cursor = feed.revision if since is None else since
        try:
            if cursor < feed.revision:
                await self._check_resumable(deployment, cursor, feed)
            # The log's revision, not the feed's: the feed may not have read a write that
            # committed before this request yet; when so, it reads now rather than at its poll.
            until = None
            if not follow:
                until = await log_store.current_revision(self.sessionmaker, deployment)
                if until > feed.revision:
                    self.poke(deployment)
        except BaseException:
            self._leave(deployment, feed)
            raise
        return Watch(self, deployment, feed, cursor, until)

    def _leave(self, deployment: str, feed: _Feed) -> None:
        feed.watchers -= 1
        if feed.watchers == 0 and self._feeds.get(deployment) is feed:
            del self._feeds[deployment]

    async def _feed(self, deployment: str) -> _Feed:
        """The deployment's feed; watchers arriving together share one read of its revision (a
        thousand at once would otherwise queue a thousand reads for the connection pool)."""
        feed = self._feeds.get(deployment)
        if feed is not None:
            return feed
        starting = self._starting.get(deployment)
        if starting is None:
            starting = asyncio.ensure_future(
                log_store.current_revision(self.sessionmaker, deployment)
            )
            self._starting[deployment] = starting
            starting.add_done_callback(lambda _: self._starting.pop(deployment, None))
        revision = await asyncio.shield(starting)
        return self._feeds.setdefault(deployment, _Feed(revision))

    async def _check_resumable(self, deployment: str, cursor: int, feed: _Feed) -> None:
        first = await log_store.read_after(self.sessionmaker, deployment, cursor, 1)
        if not first or first[0].revision != cursor + 1:
            raise EventsCompacted(
                f"deployment {deployment!r} keeps no events after revision {cursor} any more "
                f"(its revision is {feed.revision}); read the state again and watch from its "
                "revision"
            )

    async def _after(self, deployment: str, feed: _Feed, cursor: int) -> list[wire.Event]:
        """The next events after ``cursor`` this watcher has not had, up to the feed's revision."""
        window = feed.window
        if window and window[0].revision <= cursor + 1:
            return window[cursor + 1 - window[0].revision :]
        page = await log_store.read_after(self.sessionmaker, deployment, cursor, PAGE)
        page = [event for event in page if event.revision <= feed.revision]
        if not page or page[0].revision != cursor + 1:  # trimmed while this watcher lagged
            await self._check_resumable(deployment, cursor, feed)
        return page

    async def _wait(self, feed: _Feed, cursor: int) -> bool:
        """Waits until the feed passes ``cursor``; False after a quiet keepalive period."""
        async with feed.grown:
            try:
                async with asyncio.timeout(self.keepalive_seconds):
                    await feed.grown.wait_for(lambda: feed.revision > cursor or self._closed)
            except TimeoutError:
                return False
        return True

    # Reading the log.

    # The hub's loops end on ``_closed`` as well as on cancellation: on Python 3.11,
    # ``asyncio.wait_for`` returns normally when its awaitable completes as the task is cancelled,
    # and a pump that swallowed close()'s one cancel kept the app's shutdown waiting forever.
    async def _pump(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_seconds):
                    await self._wake.wait()
                self._wake.clear()
            for deployment, feed in list(self._feeds.items()):
                try:
                    await self._read(deployment, feed)
                except Exception:
                    log.warning("reading the events of %s failed", deployment, exc_info=True)

    async def _read(self, deployment: str, feed: _Feed) -> None:
        while True:
            page = await log_store.read_after(self.sessionmaker, deployment, feed.revision, PAGE)
            if not page:
                return
            feed.window.extend(page)
            if len(feed.window) > 2 * WINDOW:
                del feed.window[: len(feed.window) - WINDOW]
            async with feed.grown:
                feed.revision = page[-1].revision
                feed.grown.notify_all()
            if len(page) < PAGE:
                return

    def _mark_all(self) -> None:
        self._wake.set()

    async def _note_expiries(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.expiry_seconds)
            try:
                if await log_store.note_expiries(self.sessionmaker, now=self.clock()):
                    self._mark_all()
            except Exception:
                log.warning("noting lease expiries failed", exc_info=True)


class Watch:
    """One watcher's events, in revision order: ``async for event in watch`` (None: a keepalive),
    ending after revision ``until`` when it has one. ``close()`` when done (the handler's
    ``finally``)."""

    def __init__(
        self, hub: EventHub, deployment: str, feed: _Feed, cursor: int, until: int | None = None
    ) -> None:
        self.hub = hub
        self.deployment = deployment
        self.cursor = cursor
        self.until = until
        self._feed = feed
        self._pending: deque[wire.Event] = deque()
        self._closed = False

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> wire.Event | None:
        hub, feed = self.hub, self._feed
        if self.until is not None and self.cursor >= self.until:
            raise StopAsyncIteration
        while not self._pending:
            if hub._closed or self._closed:
                raise StopAsyncIteration
            if self.cursor < feed.revision:
                self._pending = deque(await hub._after(self.deployment, feed, self.cursor))
            elif not await hub._wait(feed, self.cursor):
                return None
        event = self._pending.popleft()
        self.cursor = event.revision
        return event

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.hub._leave(self.deployment, self._feed)
