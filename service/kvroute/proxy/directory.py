"""Which engines the proxy may pair: kvroute's pairs answer, each instance's API address, and
what the proxy itself has seen fail.

An engine's OpenAI address is the ``endpoint`` its rank 0 registered (the connector's ``endpoint``
setting). The answer is cached for ``refresh_s``: a registration or a lease that ends shows within
that time, and an engine the proxy could not reach is avoided for ``cooldown_s`` at once, since
its lease may take far longer to end.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from kvroute.client import AsyncKvrouteClient, KvrouteError


class NoRoute(Exception):
    """No live, compatible pair: the proxy answers 503 with this reason."""


@dataclass(frozen=True, slots=True)
class Engine:
    instance: str
    url: str  # the engine's OpenAI server, e.g. http://10.0.0.5:8000


@dataclass
class Directory:
    client: AsyncKvrouteClient
    deployment: str
    refresh_s: float = 1.0
    cooldown_s: float = 10.0
    _pairs: list[tuple[str, str, int]] = field(default_factory=list)  # gen, ctx, preference
    _urls: dict[str, str] = field(default_factory=dict)
    _why: str = "kvroute has not been asked yet"
    _fetched: float = float("-inf")
    _down: dict[str, float] = field(default_factory=dict)  # instance -> until when
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    busy: Counter[str] = field(default_factory=Counter)  # requests in flight per instance

    async def choose(self, exclude: frozenset[str] = frozenset()) -> tuple[Engine, Engine]:
        """(producer, consumer): the least busy consumer, then its best least busy producer."""
        await self._refresh()
        now = time.monotonic()
        usable = [
            (gen, ctx, preference)
            for gen, ctx, preference in self._pairs
            if self._up(gen, now) and self._up(ctx, now) and not {gen, ctx} & exclude
        ]
        if not usable:
            down = sorted(name for name, until in self._down.items() if until > now)
            raise NoRoute(self._why + (f"; unreachable now: {', '.join(down)}" if down else ""))
        gen, ctx, _ = min(usable, key=lambda p: (self.busy[p[0]], p[2], self.busy[p[1]], p[1]))
        return Engine(ctx, self._urls[ctx]), Engine(gen, self._urls[gen])

    def unreachable(self, instance: str) -> None:
        self._down[instance] = time.monotonic() + self.cooldown_s

    def _up(self, instance: str, now: float) -> bool:
        return self._down.get(instance, 0.0) <= now and instance in self._urls

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._fetched < self.refresh_s:
                return
            try:
                await self._fetch()
            except KvrouteError as error:
                if not self._pairs:
                    self._why = f"kvroute answered {error.code}: {error.detail}"
            except (TimeoutError, OSError) as error:
                # Keep serving the pairs known: engines outlive a kvroute restart.
                if not self._pairs:
                    self._why = f"kvroute is unreachable ({error!r})"
            self._fetched = time.monotonic()

    async def _fetch(self) -> None:
        answer = await self.client.pairs(self.deployment)
        pairs, excluded = [], []
        for generation in answer.generation:
            pairs += [(generation.instance, p.context, p.preference) for p in generation.pairs]
            excluded += [
                f"{generation.instance}/{e.context}: {e.code}" for e in generation.excluded
            ]
        urls = dict(self._urls)
        for name in {name for pair in pairs for name in pair[:2]} - urls.keys():
            document = (await self.client.get_rank(self.deployment, name, 0)).document
            if document.get("endpoint"):
                urls[name] = str(document["endpoint"]).rstrip("/")
        self._pairs, self._urls = pairs, urls
        missing = sorted({name for pair in pairs for name in pair[:2]} - urls.keys())
        self._why = (
            f"deployment {self.deployment!r} has no allowed pair of live engines"
            + (f" (excluded: {'; '.join(excluded)})" if excluded else "")
            + (f"; no endpoint registered by {', '.join(missing)}" if missing else "")
        )
