"""Keeps one rank registered for as long as its worker lives.

A background task heartbeats at a third of the lease, so two heartbeats can be lost before the
lease lapses. When kvroute answers 404 it has forgotten the rank (the lease expired while the
worker was stalled, an operator or the reaper removed it, or kvroute restarted on a fresh
database): the keeper registers the same document again, which is exactly what a restarted worker
would do, and plans built afterwards name the new generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

from kvroute.client.errors import KvrouteError
from kvroute.client.models import Registered

if TYPE_CHECKING:  # the client creates keepers; a keeper only calls it
    from kvroute.client.aio import AsyncKvrouteClient

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 30  # API.md's default when a document names none


class LeaseKeeper:
    """``async with LeaseKeeper(client, "llama", "ctx0", 0, document) as keeper: ...``"""

    def __init__(
        self,
        client: AsyncKvrouteClient,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        interval: float | None = None,
    ) -> None:
        self.client = client
        self.deployment = deployment
        self.instance = instance
        self.rank = rank
        self.document = dict(document)
        lease = int(self.document.get("lease_seconds") or DEFAULT_LEASE_SECONDS)
        self.interval = interval if interval is not None else lease / 3
        self.registered: Registered | None = None
        self.lease_expires_at: datetime | None = None
        self.heartbeats = 0
        self.reregistrations = 0
        self.last_error: KvrouteError | None = None
        self._task: asyncio.Task[None] | None = None
        self._reregistered = asyncio.Event()

    @property
    def generation(self) -> int | None:
        return None if self.registered is None else self.registered.generation

    @property
    def running(self) -> bool:
        """True while the heartbeat task runs (between ``start`` and ``stop``)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> Registered:
        """Registers (raising a refusal as ``KvrouteError``), then heartbeats in the background."""
        await self._register()
        self._task = asyncio.create_task(
            self._run(), name=f"kvroute-lease-{self.instance}-{self.rank}"
        )
        assert self.registered is not None
        return self.registered

    async def stop(self, *, deregister: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister:
            with contextlib.suppress(KvrouteError):
                await self.client.deregister(self.deployment, self.instance, self.rank)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_reregistered(self, limit_s: float, *, since: int | None = None) -> Registered:
        """Waits until the keeper has re-registered more than ``since`` times (default: the count
        now), for tests and workers that must refresh plans. Pass the count read before whatever
        makes kvroute forget the rank: the keeper may re-register before this call is reached."""
        seen = self.reregistrations if since is None else since
        async with asyncio.timeout(limit_s):
            while self.reregistrations <= seen:
                self._reregistered.clear()
                await self._reregistered.wait()
        if self.registered is None:
            raise RuntimeError("the lease keeper was never started")
        return self.registered

    async def _register(self) -> None:
        self.registered = await self.client.register(
            self.deployment, self.instance, self.rank, self.document
        )
        self.lease_expires_at = self.registered.lease_expires_at

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._renew()
                self.last_error = None
            except KvrouteError as error:
                # Out of reach or refused: keep the worker running and try again next interval;
                # the lease still has two intervals to go.
                self.last_error = error
                log.warning("lease of %s rank %d not renewed: %s", self.instance, self.rank, error)

    async def _renew(self) -> None:
        try:
            lease = await self.client.heartbeat(self.deployment, self.instance, self.rank)
        except KvrouteError as error:
            if not error.not_found:
                raise
            log.warning(
                "kvroute forgot %s rank %d (%s); registering again",
                self.instance,
                self.rank,
                error.detail,
            )
            await self._register()
            self.reregistrations += 1
            self._reregistered.set()
            return
        self.heartbeats += 1
        self.lease_expires_at = lease.lease_expires_at
