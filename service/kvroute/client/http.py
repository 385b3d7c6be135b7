"""One kvroute service over HTTP, as every client call reaches it.

One ``aiohttp.ClientSession`` per client (connection reuse matters: a worker heartbeats and fetches
plans for its whole life). Every call goes through ``_call``: bearer token, per-request timeout,
bounded retries on "no answer" and 429/503, and every other non-2xx answer raised as one
``KvrouteError`` carrying the problem+json members.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import quote

import aiohttp

from kvroute.client.errors import KvrouteError
from kvroute.client.retry import RETRY_STATUSES, RetryPolicy, parse_retry_after

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
# Methods whose repetition cannot do harm; a POST that may have reached the server is not resent.
IDEMPOTENT = frozenset({"GET", "PUT", "DELETE"})


def segment(value: str | int) -> str:
    """``value`` as one path segment (every character outside the unreserved set escaped)."""
    return quote(str(value), safe="")


class ServiceCalls:
    """The session, token, timeout and retry policy the client's calls share; the calls of each
    area (``KvIntegrityCalls``, ``AsyncKvrouteClient``) build on ``_call``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily so the session binds to the loop the client is first used on.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str | int] | None = None,
        retry_sent: bool | None = None,
    ) -> tuple[int, Any]:
        """(status, JSON body or None) of a 2xx answer; raises ``KvrouteError`` otherwise."""
        resend = method in IDEMPOTENT if retry_sent is None else retry_sent
        url = self.base_url + path
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                async with self._client().request(method, url, json=body, params=params) as resp:
                    if resp.status in RETRY_STATUSES and not last:
                        wait = parse_retry_after(resp.headers.get("Retry-After"))
                        await self._backoff(method, path, attempt, f"status {resp.status}", wait)
                        continue
                    payload = await _payload(resp)
                    if resp.status >= 400:
                        raise KvrouteError.from_problem(
                            resp.status, payload, reason=resp.reason or ""
                        )
                    return resp.status, payload
            except aiohttp.ClientConnectorError as error:  # never reached the server: always safe
                if last:
                    raise KvrouteError.unreachable(
                        "unreachable", f"{method} {url}: {error}"
                    ) from error
                await self._backoff(method, path, attempt, str(error), None)
            except aiohttp.ClientConnectionError as error:  # may have been processed
                if last or not resend:
                    raise KvrouteError.unreachable(
                        "connection_lost", f"{method} {url}: {error}"
                    ) from error
                await self._backoff(method, path, attempt, str(error), None)
            except TimeoutError as error:
                raise KvrouteError.unreachable(
                    "timeout", f"{method} {url}: no answer within {self._timeout.total} s"
                ) from error
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _backoff(
        self, method: str, path: str, attempt: int, why: str, retry_after: float | None
    ) -> None:
        delay = self.retry.delay(attempt, retry_after)
        log.info("kvroute %s %s: %s; retry %d in %.2f s", method, path, why, attempt + 1, delay)
        await asyncio.sleep(delay)


async def _payload(resp: aiohttp.ClientResponse) -> Any:
    if resp.status == 204:
        return None
    text = await resp.text()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text
