"""Waves: concurrent calls of one key share one database round trip.

The first call of a key starts a wave at once; calls that arrive while it is in flight wait and
form the next wave, which starts when that one ends. So every call is answered by work that began
after it arrived (a plan read never sees the registry as of before it asked, a heartbeat is
committed after it was sent), a quiet key sees waves of one and waits for nothing, and a fleet's
hundreds of calls per second cost a few round trips instead of hundreds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Answer = TypeVar("Answer")

MAX_WAVE = 256  # bounds one statement's size; the rest wait for the next wave


class Waves(Generic[Item, Answer]):
    """``run(key, items)`` answers a wave's items in order; its exception fails the whole wave.

    ``distinct`` names what may appear once per wave (e.g. a rank): a repeat ends the wave there
    and is served by the next one, so a wave's answers equal those of running its calls one by one.
    """

    def __init__(
        self,
        run: Callable[[str, list[Item]], Awaitable[Sequence[Answer]]],
        *,
        name: str,
        distinct: Callable[[Item], Hashable] | None = None,
        max_wave: int = MAX_WAVE,
    ) -> None:
        self._run = run
        self._name = name
        self._distinct = distinct
        self._max_wave = max_wave
        self._queues: dict[str, list[tuple[Item, asyncio.Future[Answer]]]] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}

    async def submit(self, key: str, item: Item) -> Answer:
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, []).append((item, answer))
        if key not in self._drains:
            self._drains[key] = asyncio.create_task(
                self._drain(key), name=f"kvroute-{self._name}-{key}"
            )
        return await answer

    async def _drain(self, key: str) -> None:
        queue = self._queues[key]
        wave: list[tuple[Item, asyncio.Future[Answer]]] = []
        try:
            while queue:
                wave = self._take(queue)
                try:
                    answers = await self._run(key, [item for item, _ in wave])
                except Exception as error:  # the database failed the whole wave
                    for _, answer in wave:
                        if not answer.done():
                            answer.set_exception(error)
                    continue
                for (_, answer), value in zip(wave, answers, strict=True):
                    if not answer.done():  # its caller went away; the work still took effect
                        answer.set_result(value)
                wave = []
        finally:
            del self._drains[key]
            del self._queues[key]
            for _, answer in wave + queue:  # only when the drain itself was cancelled (shutdown)
                answer.cancel()

    def _take(
        self, queue: list[tuple[Item, asyncio.Future[Answer]]]
    ) -> list[tuple[Item, asyncio.Future[Answer]]]:
        count, seen = 0, set()
        for item, _ in queue[: self._max_wave]:
            if self._distinct is not None:
                marker = self._distinct(item)
                if marker in seen:
                    break
                seen.add(marker)
            count += 1
        wave = queue[:count]
        del queue[:count]
        return wave
