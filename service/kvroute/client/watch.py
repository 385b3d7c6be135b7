"""Watching a deployment's changes instead of polling: ``GET /v1/deployments/{d}/events``.

``EventWatcher`` reads the server-sent event stream and yields each ``kvroute.wire.Event`` once,
in revision order. When the connection drops (a replica restarting, a proxy timing out) it
reconnects, through the client's bounded backoff, from the last revision it delivered
(``Last-Event-ID``), so a reconnect misses no event and repeats none. A 410 ``events_compacted``
(the watcher fell further behind than the server keeps) is raised: read the state again, then
watch from ``revision``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp

from kvroute import wire
from kvroute.client.errors import KvrouteError

if TYPE_CHECKING:
    from kvroute.client.aio import AsyncKvrouteClient

log = logging.getLogger(__name__)

# The server sends a keepalive at least every 15 s; a silent connection is dead well before this.
READ_TIMEOUT_S = 45.0


class EventWatcher:
    """``async for event in EventWatcher(client, "llama"):`` (``since``: resume after a revision;
    default: changes from now on)."""

    def __init__(
        self,
        client: AsyncKvrouteClient,
        deployment: str,
        *,
        since: int | None = None,
        read_timeout: float = READ_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.deployment = deployment
        self.revision = since  # the last revision delivered (or watched from)
        self.read_timeout = read_timeout
        self.reconnects = 0

    def __aiter__(self) -> AsyncIterator[wire.Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[wire.Event]:
        attempt = 0
        while True:
            try:
                async for event in self._stream():
                    attempt = 0
                    yield event
                reason = "the stream ended"
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
                reason = str(error) or type(error).__name__
            except KvrouteError as error:
                if (
                    not error.retryable
                ):  # 410 events_compacted, 401, 404 ...: the caller's to handle
                    raise
                reason = str(error)
            if attempt + 1 >= self.client.retry.attempts:
                raise KvrouteError.unreachable("events_lost", f"{self.deployment}: {reason}")
            delay = self.client.retry.delay(attempt, None)
            log.info(
                "event stream of %s: %s; reconnecting in %.2f s", self.deployment, reason, delay
            )
            attempt += 1
            self.reconnects += 1
            await asyncio.sleep(delay)

    async def _stream(self) -> AsyncIterator[wire.Event]:
        url = f"{self.client.base_url}/v1/deployments/{self.deployment}/events"
        headers = {} if self.revision is None else {"Last-Event-ID": str(self.revision)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.read_timeout)
        session = self.client._client()
        async with session.get(url, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                body = await response.json(content_type=None)
                raise KvrouteError.from_problem(response.status, body, reason=response.reason or "")
            async for kind, data, comment in _frames(response.content):
                if comment is not None and comment.startswith("revision "):
                    if self.revision is None:
                        self.revision = int(comment.removeprefix("revision "))
                    continue
                if kind is None:
                    continue
                event = wire.from_json(wire.Event, json.loads(data))
                if self.revision is not None and event.revision <= self.revision:
                    continue  # never twice, whatever the server resends
                self.revision = event.revision
                yield event


async def _frames(
    content: aiohttp.StreamReader,
) -> AsyncIterator[tuple[str | None, str, str | None]]:
    """(event kind, data, comment) per server-sent event block."""
    kind: str | None = None
    data: list[str] = []
    comment: str | None = None
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if kind is not None or data or comment is not None:
                yield (kind or "message") if data else None, "\n".join(data), comment
            kind, data, comment = None, [], None
        elif line.startswith(":"):
            comment = line[1:].strip()
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                kind = value
            elif name == "data":
                data.append(value)
