"""Retries: 503/429 and refused connections are retried with backoff; nothing else is."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.client import AsyncKvrouteClient, KvrouteError, RetryPolicy, parse_retry_after
from tests.client.live import free_port

FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)
LEASE = {"lease_expires_at": "2030-01-01T00:00:00+00:00"}


def scripted(answers: list[tuple[int, dict[str, str]]]) -> tuple[web.Application, list[float]]:
    """An app answering the heartbeat path with ``answers`` in turn, recording arrival times."""
    arrivals: list[float] = []

    async def heartbeat(request: web.Request) -> web.Response:
        import time

        arrivals.append(time.monotonic())
        status, headers = answers[min(len(arrivals) - 1, len(answers) - 1)]
        if status == 200:
            return web.json_response(LEASE)
        body: dict[str, Any] = {"status": status, "code": "busy", "detail": "try later"}
        return web.json_response(
            body, status=status, headers=headers, content_type="application/problem+json"
        )

    app = web.Application()
    app.router.add_post("/v1/deployments/d/instances/i/ranks/0/heartbeat", heartbeat)
    return app, arrivals


async def test_503_then_200_is_retried() -> None:
    app, arrivals = scripted([(503, {}), (503, {}), (200, {})])
    async with (
        TestServer(app, host="127.0.0.1") as server,
        AsyncKvrouteClient(str(server.make_url("")), retry=FAST) as client,
    ):
        lease = await client.heartbeat("d", "i", 0)
    assert len(arrivals) == 3
    assert lease.lease_expires_at.year == 2030


async def test_429_honours_retry_after() -> None:
    app, arrivals = scripted([(429, {"Retry-After": "1"}), (200, {})])
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=2.0)
    async with (
        TestServer(app, host="127.0.0.1") as server,
        AsyncKvrouteClient(str(server.make_url("")), retry=policy) as client,
    ):
        await client.heartbeat("d", "i", 0)
    assert len(arrivals) == 2
    assert arrivals[1] - arrivals[0] >= 0.95  # the server's floor, not the 10 ms base delay


async def test_attempts_are_bounded_and_the_last_answer_is_raised() -> None:
    app, arrivals = scripted([(503, {})])
    async with (
        TestServer(app, host="127.0.0.1") as server,
        AsyncKvrouteClient(str(server.make_url("")), retry=FAST) as client,
    ):
        with pytest.raises(KvrouteError) as busy:
            await client.heartbeat("d", "i", 0)
    assert len(arrivals) == FAST.attempts
    assert (busy.value.status, busy.value.code, busy.value.detail) == (503, "busy", "try later")


@pytest.mark.parametrize("status", [400, 404, 409, 500])
async def test_other_statuses_are_not_retried(status: int) -> None:
    app, arrivals = scripted([(status, {})])
    async with (
        TestServer(app, host="127.0.0.1") as server,
        AsyncKvrouteClient(str(server.make_url("")), retry=FAST) as client,
    ):
        with pytest.raises(KvrouteError) as refused:
            await client.heartbeat("d", "i", 0)
    assert len(arrivals) == 1
    assert refused.value.status == status


async def test_refused_connection_is_retried_until_the_server_appears() -> None:
    port = free_port()
    app, arrivals = scripted([(200, {})])
    server = TestServer(app, host="127.0.0.1", port=port)
    refused = asyncio.Event()
    policy = _noting(refused, after=3, attempts=30, base_delay=0.05, max_delay=0.1)
    async with AsyncKvrouteClient(f"http://127.0.0.1:{port}", retry=policy) as client:
        call = asyncio.create_task(client.heartbeat("d", "i", 0))
        async with asyncio.timeout(10):
            await refused.wait()  # three attempts met the closed port; the client backs off
        assert not call.done()  # still retrying against a closed port
        await server.start_server()
        try:
            lease = await asyncio.wait_for(call, timeout=10)
        finally:
            await server.close()
    assert len(arrivals) == 1
    assert lease.lease_expires_at.year == 2030


def _noting(event: asyncio.Event, *, after: int, **policy: Any) -> RetryPolicy:
    """A policy that sets ``event`` when the client asks for its delay before retry ``after``:
    the test then knows, without timing, that as many attempts failed and the client retries on."""

    class Noting(RetryPolicy):
        def delay(
            self, retry: int, retry_after: float | None = None, rng: random.Random | None = None
        ) -> float:
            if retry + 1 >= after:
                event.set()
            return RetryPolicy.delay(self, retry, retry_after, rng)

    return Noting(**policy)


def test_backoff_grows_exponentially_within_jitter() -> None:
    policy = RetryPolicy(attempts=6, base_delay=0.1, max_delay=1.0)
    rng = random.Random(7)
    for retry in range(6):
        ceiling = min(1.0, 0.1 * 2**retry)
        delays = [policy.delay(retry, rng=rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # full jitter spans the range
    assert policy.delay(0, retry_after=0.5, rng=rng) >= 0.5
    assert policy.delay(0, retry_after=60, rng=rng) == 1.0  # capped


def test_retry_after_forms() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_retry_after("3") == 3.0
    assert (
        parse_retry_after(format_datetime(now + timedelta(seconds=7), usegmt=True), now=now) == 7.0
    )
    assert (
        parse_retry_after(format_datetime(now - timedelta(seconds=7), usegmt=True), now=now) == 0.0
    )
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="base_delay"):
        RetryPolicy(base_delay=2, max_delay=1)
