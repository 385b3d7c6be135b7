"""Producer plans fetched off the engine's step: a thread of its own keeps them ready.

``start_load_kv`` runs inside vLLM's step, so it must not wait on kvroute. The consumer's
``Prefetcher`` fetches, on a private event loop, each producer instance's plan for this rank and
every producer rank's document (NIXL metadata, pool addresses), at start-up for every context
instance of the deployment and later for any instance a request names. It follows the deployment's
event stream: when a producer instance re-registers, expires or is deleted its entry is dropped
and fetched again, so a plan of an old generation is never used after kvroute announced the new.
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
CHANGES = frozenset({"rank_registered", "rank_expired", "rank_deleted", "plans_invalidated"})


@dataclass(frozen=True, slots=True)
class Fetched:
    """A producer instance as kvroute answered: this rank's plan and every producer rank's
    document; or the error that prevented it."""

    plan: Plan | None
    documents: Mapping[int, Mapping[str, Any]]
    error: str | None = None


class Prefetcher:
    def __init__(
        self, url: str, token: str | None, deployment: str, instance: str, rank: int
    ) -> None:
        self.url, self.token = url, token
        self.deployment, self.instance, self.rank = deployment, instance, rank
        self._ready: dict[str, Fetched] = {}
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
            fetched = Fetched(None, {}, f"no plan from {producer}: {error}")
        finally:
            self._fetching.discard(producer)
        with self._lock:
            self._ready[producer] = fetched

    def _changed(self, instance: str) -> None:
        """A producer's change stales its entry; this instance's own stales every entry."""
        with self._lock:
            names = list(self._ready) if instance == self.instance else [instance]
            stale = [name for name in names if self._ready.pop(name, None) is not None]
        for name in stale:
            self._want(name)

    async def _watch(self) -> None:
        """Drops and refetches a producer whenever kvroute reports a change of its ranks."""
        while True:
            try:
                async for event in EventWatcher(self._client, self.deployment):
                    if event.kind in CHANGES and event.instance:
                        self._changed(event.instance)
            except (TimeoutError, KvrouteError, OSError) as error:
                log.warning("kvroute event stream ended (%s); watching again", error)
                with self._lock:  # a missed change must not leave a stale plan in use
                    self._ready.clear()
                await asyncio.sleep(2.0)
