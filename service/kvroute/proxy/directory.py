"""Which engines the proxy may pair: kvroute's pairs answer, each instance's API address, and
what the proxy itself has seen fail.

An engine's OpenAI address is the ``endpoint`` its rank 0 registered (the connector's ``endpoint``
setting), read again on every refresh: an engine that restarted on another port is reached there
at once, and one that registered anew (a new generation) is no longer avoided for having been
unreachable. The answer is cached for ``refresh_s``: a registration or a lease that ends shows
within that time, and an engine the proxy could not reach is avoided for ``cooldown_s`` at once,
since its lease may take far longer to end.

kvroute out of reach (no answer, or a 5xx) is not news about the engines, which outlive it: the
proxy keeps routing from kvroute's last answer for up to ``hold_s`` after it, then refuses naming
the outage; meanwhile it asks kvroute in the background, so no request waits on kvroute's timeouts. When kvroute answers again after an outage, the engines' leases may have lapsed
only because kvroute could not hear their renewals; a pair its first answers drop for that alone
(an instance missing or ``instance_incomplete``) is still routed for ``hold_s`` while the
engines' lease keepers register them again. Any other exclusion takes effect at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from kvroute.client import AsyncKvrouteClient, KvrouteError, RankInfo

INCOMPLETE = "instance_incomplete"  # kvroute's exclusion of a pair with a rank not live
Pair = tuple[str, str, int]  # generation instance, context instance, preference


class NoRoute(Exception):
    """No live, compatible pair: the proxy answers 503 with this reason."""


@dataclass(frozen=True, slots=True)
class Engine:
    instance: str
    url: str  # the engine's OpenAI server, e.g. http://10.0.0.5:8000


@dataclass(frozen=True, slots=True)
class Answer:
    """kvroute's pairs answer as the proxy keeps it."""

    pairs: list[Pair]
    hard: set[tuple[str, str]]  # pairs excluded for a reason other than a rank not live
    urls: dict[str, str]
    generations: dict[str, int]
    why: str


@dataclass
class Directory:
    client: AsyncKvrouteClient
    deployment: str
    refresh_s: float = 1.0
    cooldown_s: float = 10.0
    hold_s: float = 120.0  # how long kvroute's last answer is routed from while kvroute is out
    _pairs: list[Pair] = field(default_factory=list)
    _urls: dict[str, str] = field(default_factory=dict)
    _generations: dict[str, int] = field(default_factory=dict)
    _why: str = "kvroute has not been asked yet"
    _fetched: float = float("-inf")
    _answered: float = float("-inf")  # when kvroute last answered
    _lost: float | None = None  # when kvroute stopped answering; None while it answers
    _back: float = float("-inf")  # when kvroute answered again after an outage
    _carry: list[Pair] = field(default_factory=list)  # routed during that outage
    _down: dict[str, float] = field(default_factory=dict)  # instance -> until when
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _behind: asyncio.Task[None] | None = None  # a refresh while kvroute is out of reach
    busy: Counter[str] = field(default_factory=Counter)  # requests in flight per instance

    async def choose(self, exclude: frozenset[str] = frozenset()) -> tuple[Engine, Engine]:
        """(producer, consumer): the least busy consumer, then its best least busy producer."""
        if self._lost is None or not self._pairs:
            await self._refresh()
        elif self._behind is None or self._behind.done():
            # kvroute is out: a request must not wait on its timeouts and retries.
            self._behind = asyncio.create_task(self._refresh())
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
                answer = await self._fetch()
            except KvrouteError as error:
                if error.status is None or error.status >= 500:
                    self._out_of_reach(f"{error.code}: {error.detail}")
                elif not self._pairs:
                    self._why = f"kvroute answered {error.code}: {error.detail}"
            except (TimeoutError, OSError) as error:
                self._out_of_reach(repr(error))
            else:
                self._take(answer)
            self._fetched = time.monotonic()

    def _out_of_reach(self, error: str) -> None:
        """Keeps routing from the last answer, for ``hold_s`` after it."""
        now = time.monotonic()
        if self._lost is None:
            self._lost = now
        if now - self._answered <= self.hold_s:
            return
        self._pairs = []
        self._why = f"kvroute is unreachable ({error})"
        if self._answered > float("-inf"):
            self._why += (
                f" since {now - self._lost:.0f} s, and its last answer is older than the "
                f"{self.hold_s:g} s the proxy routes from"
            )

    def _take(self, answer: Answer) -> None:
        now = time.monotonic()
        if self._lost is not None:  # back after an outage: what was routed may carry over
            self._lost, self._back, self._carry = None, now, list(self._pairs)
        fresh = {pair[:2] for pair in answer.pairs}
        carried = []
        if now - self._back < self.hold_s:
            carried = [
                pair
                for pair in self._carry
                if pair[:2] not in fresh and pair[:2] not in answer.hard and pair[0] in self._urls
                and pair[1] in self._urls
            ]  # fmt: skip
        urls = {name: url for name, url in self._urls.items() if _named(name, carried)}
        urls.update(answer.urls)
        for name, generation in answer.generations.items():
            if self._generations.get(name, generation) != generation:
                self._down.pop(name, None)  # registered anew: its old failures say nothing
        self._pairs, self._urls = answer.pairs + carried, urls
        self._generations.update(answer.generations)
        self._why, self._answered = answer.why, now

    async def _fetch(self) -> Answer:
        try:
            answer = await self.client.pairs(self.deployment)
        except KvrouteError as error:
            if not error.not_found:
                raise
            # The deployment is unknown (never registered, or kvroute restarted empty).
            return Answer([], set(), {}, {}, f"kvroute answered {error.code}: {error.detail}")
        pairs: list[Pair] = []
        excluded, hard = [], set()
        for generation in answer.generation:
            pairs += [(generation.instance, p.context, p.preference) for p in generation.pairs]
            for e in generation.excluded:
                excluded.append(f"{generation.instance}/{e.context}: {e.code}")
                if e.code != INCOMPLETE:
                    hard.add((generation.instance, e.context))
        names = sorted({name for pair in pairs for name in pair[:2]})
        found = await asyncio.gather(*(self._rank0(name) for name in names))
        ranks = {name: rank for name, rank in zip(names, found, strict=True) if rank is not None}
        urls = {
            name: str(rank.document["endpoint"]).rstrip("/")
            for name, rank in ranks.items()
            if rank.document.get("endpoint")
        }
        missing = sorted(set(names) - urls.keys())
        why = (
            f"deployment {self.deployment!r} has no allowed pair of live engines"
            + (f" (excluded: {'; '.join(excluded)})" if excluded else "")
            + (f"; no endpoint registered by {', '.join(missing)}" if missing else "")
        )
        generations = {name: rank.generation for name, rank in ranks.items()}
        return Answer(pairs, hard, urls, generations, why)

    async def _rank0(self, name: str) -> RankInfo | None:
        """The instance's rank 0 (its address and generation); None if it went meanwhile."""
        try:
            return await self.client.get_rank(self.deployment, name, 0)
        except KvrouteError as error:
            if error.not_found:
                return None
            raise


def _named(name: str, pairs: list[Pair]) -> bool:
    return any(name in pair[:2] for pair in pairs)
