"""Keeps ranks registered for as long as their worker lives.

A background task renews at a third of the lease, so two renewals can be lost before the lease
lapses. A renewal that fails (kvroute out of reach, restarting, or refusing for now) is tried
again after ``RETRY_FIRST_S``, then at doubling delays up to the interval, and always early enough
for two more tries before the lease would lapse (by this process's clock, from its last renewal);
once lapsed, every ``RETRY_LAPSED_S`` at most, so the ranks register again soon after kvroute is
back. A short kvroute outage costs a second or two of renewals, never the lease. By default an engine lease keeps the ranks (``EngineLeaseKeeper``: one lease for all the
ranks a process owns, one renewal for all of them); ``per_rank=True``, or a server without engine
leases, heartbeats each rank on its own. When kvroute has forgotten a rank (its lease expired while
the worker was stalled, an operator or the reaper removed it, or kvroute restarted on a fresh
database) the keeper registers the same document again, exactly what a restarted worker would do,
and plans built afterwards name the new generation: a renewal answering 404 means the whole lease
is gone (a new lease is granted and every rank registered with it), a renewal that leaves out a
rank means that rank alone is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

from kvroute.client.errors import KvrouteError
from kvroute.client.models import Registered

if TYPE_CHECKING:  # the client creates keepers; a keeper only calls it
    from kvroute.client.aio import AsyncKvrouteClient

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 30  # docs/geometry.md's default when a document names none
RankKey = tuple[str, int]  # (instance, rank)
RETRY_FIRST_S = 1.0  # the first retry of a failed renewal; later ones double up to the interval
RETRY_LAPSED_S = 2.0  # the longest wait between tries once the lease has lapsed


class EngineLeaseKeeper:
    """``async with EngineLeaseKeeper(client, "llama", {("ctx0", 0): doc0, ...}) as keeper: ...``

    The lease lasts the shortest ``lease_seconds`` of the documents.
    """

    def __init__(
        self,
        client: AsyncKvrouteClient,
        deployment: str,
        documents: Mapping[RankKey, Mapping[str, Any]],
        *,
        interval: float | None = None,
        per_rank: bool = False,
    ) -> None:
        self.client = client
        self.deployment = deployment
        self.documents = {key: dict(document) for key, document in documents.items()}
        self.lease_seconds = min(
            int(document.get("lease_seconds") or DEFAULT_LEASE_SECONDS)
            for document in self.documents.values()
        )
        self.interval = interval if interval is not None else self.lease_seconds / 3
        self.per_rank = per_rank
        self.lease_id: str | None = None
        self.registered: dict[RankKey, Registered] = {}
        self.lease_expires_at: datetime | None = None
        self.heartbeats = 0
        self.reregistrations = 0
        self.last_error: KvrouteError | None = None
        self._task: asyncio.Task[None] | None = None
        self._reregistered = asyncio.Event()
        self._renewed_at = float("-inf")  # time.monotonic() of the last renewal that took

    @property
    def running(self) -> bool:
        """True while the renewal task runs (between ``start`` and ``stop``)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> dict[RankKey, Registered]:
        """Registers every rank (raising a refusal as ``KvrouteError``), then renews in the
        background."""
        await self._acquire()
        self._task = asyncio.create_task(self._run(), name=f"kvroute-lease-{self.deployment}")
        return self.registered

    async def stop(self, *, deregister: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not deregister:
            return
        with contextlib.suppress(KvrouteError):
            if self.lease_id is not None:
                await self.client.revoke_lease(self.deployment, self.lease_id)
                return
            for instance, rank in self.documents:
                await self.client.deregister(self.deployment, instance, rank)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_reregistered(self, limit_s: float, *, since: int | None = None) -> None:
        """Waits until the keeper has re-registered more than ``since`` times (default: the count
        now), for tests and workers that must refresh plans. Pass the count read before whatever
        makes kvroute forget a rank: the keeper may re-register before this call is reached."""
        seen = self.reregistrations if since is None else since
        async with asyncio.timeout(limit_s):
            while self.reregistrations <= seen:
                self._reregistered.clear()
                await self._reregistered.wait()

    async def _acquire(self) -> None:
        """A lease (unless per rank) and every rank registered with it."""
        if not self.per_rank:
            try:
                lease = await self.client.grant_lease(self.deployment, self.lease_seconds)
            except KvrouteError as error:
                if error.status not in (404, 405):
                    raise
                log.warning("kvroute has no engine leases (%s); keeping per-rank leases", error)
                self.per_rank = True
            else:
                self.lease_id = lease.lease_id
        await self._register(list(self.documents))

    async def _register(self, keys: Sequence[RankKey]) -> None:
        answers = await asyncio.gather(
            *(
                self.client.register(
                    self.deployment, instance, rank, self.documents[instance, rank],
                    engine_lease=self.lease_id,
                )
                for instance, rank in keys
            )
        )  # fmt: skip
        for key, answer in zip(keys, answers, strict=True):
            self.registered[key] = answer
            self.lease_expires_at = answer.lease_expires_at
        self._renewed_at = time.monotonic()

    async def _run(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.retry_delay(failures))
            try:
                await self._renew()
                self.last_error, failures = None, 0
            except KvrouteError as error:
                # Out of reach or refused: keep the worker running and try again soon; waiting a
                # whole interval could let a short kvroute outage end the lease.
                self.last_error, failures = error, failures + 1
                log.warning("lease of %s not renewed (%d in a row): %s", self._names(),
                            failures, error)  # fmt: skip

    def retry_delay(self, failures: int) -> float:
        """Seconds before the next renewal: the interval, or after ``failures`` failed renewals
        in a row ``RETRY_FIRST_S`` doubling per failure, never above the interval."""
        if failures == 0:
            return self.interval
        delay = min(self.interval, RETRY_FIRST_S * 2 ** (failures - 1))
        left = self._renewed_at + self.lease_seconds - time.monotonic()
        if left <= 0:
            return min(delay, RETRY_LAPSED_S)
        return min(delay, max(RETRY_FIRST_S, left / 3))

    async def _renew(self) -> None:
        if self.lease_id is None:
            await self._renew_each()
            return
        try:
            lease = await self.client.renew_lease(self.deployment, self.lease_id)
        except KvrouteError as error:
            if not error.not_found:
                raise
            log.warning(
                "kvroute forgot the lease of %s (%s); granting another", self._names(), error
            )
            await self._acquire()
            self._note_reregistered()
            return
        self.heartbeats += 1
        self.lease_expires_at = lease.lease_expires_at
        self._renewed_at = time.monotonic()
        renewed = {(kept.instance, kept.rank) for kept in lease.ranks}
        gone = [key for key in self.documents if key not in renewed]
        if gone:
            log.warning("kvroute forgot %s; registering again", ", ".join(map(str, gone)))
            await self._register(gone)
            self._note_reregistered()

    async def _renew_each(self) -> None:
        gone = []
        for instance, rank in self.documents:
            try:
                lease = await self.client.heartbeat(self.deployment, instance, rank)
            except KvrouteError as error:
                if not error.not_found:
                    raise
                log.warning("kvroute forgot %s rank %d (%s)", instance, rank, error.detail)
                gone.append((instance, rank))
                continue
            self.lease_expires_at = lease.lease_expires_at
        self.heartbeats += 1
        self._renewed_at = time.monotonic()
        if gone:
            await self._register(gone)
            self._note_reregistered()

    def _note_reregistered(self) -> None:
        self.reregistrations += 1
        self._reregistered.set()

    def _names(self) -> str:
        return ", ".join(f"{instance} rank {rank}" for instance, rank in self.documents)


class LeaseKeeper(EngineLeaseKeeper):
    """One rank: ``async with LeaseKeeper(client, "llama", "ctx0", 0, document) as keeper: ...``

    An engine lease of its own by default (``per_rank=True``: the rank's own heartbeats).
    """

    def __init__(
        self,
        client: AsyncKvrouteClient,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        interval: float | None = None,
        per_rank: bool = False,
    ) -> None:
        super().__init__(
            client, deployment, {(instance, rank): document}, interval=interval, per_rank=per_rank
        )
        self.instance = instance
        self.rank = rank
        self.document = self.documents[instance, rank]

    @property
    def generation(self) -> int | None:
        answer = self.registered.get((self.instance, self.rank))
        return None if answer is None else answer.generation

    async def start(self) -> Registered:  # type: ignore[override]
        """Registers (raising a refusal as ``KvrouteError``), then renews in the background."""
        await super().start()
        return self.registered[self.instance, self.rank]

    async def wait_reregistered(  # type: ignore[override]
        self, limit_s: float, *, since: int | None = None
    ) -> Registered:
        await super().wait_reregistered(limit_s, since=since)
        return self.registered[self.instance, self.rank]
