"""Producer plans fetched off the engine's step: a thread of its own keeps them ready.

``start_load_kv`` runs inside vLLM's step, so it must not wait on kvroute. The consumer's
``Prefetcher`` fetches, on a private event loop, each producer instance's plan for this rank and
every producer rank's document (NIXL metadata, pool addresses), at start-up for every context
instance of the deployment and later for any instance a request names. It follows the deployment's
event stream: when a producer instance re-registers, expires or is deleted its entry is dropped
and fetched again, so a plan of an old generation is never used after kvroute announced the new.

A plan stays valid until its producer's generation changes, so a kvroute outage drops nothing:
while kvroute is out of reach the entries fetched keep serving (a fetch that finds kvroute
unreachable keeps the entry it would replace), and once the event stream is back every entry is
fetched again, since a change may have happened unseen; kvroute's answer replaces it, unless it
only says this rank's own lease lapsed (``receiver_not_live``: a kvroute back from an outage
longer than the lease), which its lease keeper mends by registering again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.client import AsyncKvrouteClient, KvrouteError
from kvroute.client.watch import EventWatcher
from kvroute.geometry import Plan

# Under vLLM's logger, whose handlers an engine configures: the lines land in its log.
log = logging.getLogger(f"vllm.{__name__}")
RECEIVER_NOT_LIVE = "receiver_not_live"  # kvroute's 409 code when this rank's lease lapsed
CHANGES = frozenset({"rank_registered", "rank_expired", "rank_deleted", "plans_invalidated"})


@dataclass(frozen=True, slots=True)
class Fetched:
    """A producer instance as kvroute answered: this rank's plan and every producer rank's
    document; or the error that prevented it."""

    plan: Plan | None
    documents: Mapping[int, Mapping[str, Any]]
    error: str | None = None


def _no_news_of_the_producer(error: Exception) -> bool:
    """kvroute out of reach, or refusing because this rank's own lease lapsed (kvroute restarted
    longer ago than the lease, or a renewal came late): neither says the producer changed."""
    if isinstance(error, TimeoutError | OSError):
        return True
    return isinstance(error, KvrouteError) and (
        error.status is None or error.code == RECEIVER_NOT_LIVE
    )


class Prefetcher:
    def __init__(
        self, url: str, token: str | None, deployment: str, instance: str, rank: int
    ) -> None:
        self.url, self.token = url, token
        self.deployment, self.instance, self.rank = deployment, instance, rank
        self._ready: dict[str, Fetched] = {}
        self.streams_lost = 0  # times the event stream ended (kvroute out of reach)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvroute-prefetch", daemon=True)
        self._thread.start()

    def get(self, producer: str) -> Fetched | None:
        """The producer's fetched entry, or None while it is being fetched (asked for here)."""
        with self._lock:
            found = self._ready.get(producer)
        if found is None:
            self._loop.call_soon_threadsafe(self._want, producer)
        return found

    def forget(self, producer: str) -> None:
        """Drops an entry that failed in use (a NIXL error): it is fetched again when asked."""
        with self._lock:
            self._ready.pop(producer, None)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # On the prefetch thread

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = AsyncKvrouteClient(self.url, token=self.token, timeout=10.0)
        self._fetching: set[str] = set()
        self._loop.create_task(self._start())
        try:
            self._loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def _want(self, producer: str) -> None:
        if producer not in self._fetching:
            self._fetching.add(producer)
            self._loop.create_task(self._fetch(producer))

    async def _start(self) -> None:
        self._loop.create_task(self._watch())
        try:
            instances = await self._client.instances(self.deployment)
        except (TimeoutError, KvrouteError, OSError) as error:
            log.warning("kvroute: could not list the producers to prefetch: %s", error)
            return
        for instance in instances:
            if instance.role == "context":
                self._want(instance.name)

    async def _fetch(self, producer: str) -> None:
        try:
            answer = await self._client.get_plan(
                self.deployment, sender=producer, receiver=self.instance,
                receiver_rank=self.rank, period=True,
            )  # fmt: skip
            documents = {}
            for rank in sorted(answer.sender_generations):  # every producer rank, sending or not
                documents[rank] = (
                    await self._client.get_rank(self.deployment, producer, rank)
                ).document
            fetched = Fetched(answer.plan, documents)
        except (TimeoutError, KvrouteError, OSError, ValueError) as error:
            no_news = _no_news_of_the_producer(error)
            fetched = Fetched(None, {}, f"no plan from {producer}: {error}")
        else:
            no_news = False
        finally:
            self._fetching.discard(producer)
        with self._lock:
            known = self._ready.get(producer)
            if no_news and known is not None and known.plan is not None:
                log.warning("kvroute: %s; keeping the plan fetched before", fetched.error)
                return  # the generation planned for still holds
            self._ready[producer] = fetched

    def _changed(self, instance: str) -> None:
        """A producer's change stales its entry (dropped at once); this instance's own has every
        entry fetched again, each kept until kvroute's answer replaces it: this rank's lease
        lapsing (``rank_expired``) says nothing of any producer."""
        with self._lock:
            if instance == self.instance:
                stale = list(self._ready)
            else:
                stale = [instance] if self._ready.pop(instance, None) is not None else []
        for name in stale:
            self._want(name)

    async def _watch(self) -> None:
        """Drops and refetches a producer whenever kvroute reports a change of its ranks."""
        recheck: asyncio.Task[None] | None = None
        while True:
            watcher = EventWatcher(self._client, self.deployment)
            if self.streams_lost:  # changes while the stream was down went unseen
                recheck = self._loop.create_task(self._recheck(watcher))
            try:
                async for event in watcher:
                    if event.kind in CHANGES and event.instance:
                        self._changed(event.instance)
            except (TimeoutError, KvrouteError, OSError) as error:
                self.streams_lost += 1
                log.warning("kvroute event stream ended (%s); serving the plans fetched, "
                            "watching again", error)  # fmt: skip
                if recheck is not None:
                    recheck.cancel()
                await asyncio.sleep(2.0)

    async def _recheck(self, watcher: EventWatcher) -> None:
        """Once the stream is back (it announced its revision), fetches every entry again: any
        later change comes as an event, any earlier one shows in the new answers."""
        # The watcher tells its connect only by its revision: polled.
        while watcher.revision is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        with self._lock:
            names = list(self._ready)
        for name in names:
            self._want(name)
