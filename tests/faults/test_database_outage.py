"""PostgreSQL frozen, then cut, behind a proxy: bounded 503s with Retry-After, recovery without restart.

``freeze`` plays a hung server (connections open, no byte moves), ``cut`` a dead one (connections
reset, new ones refused). With kvroute's database timeouts set short, registrations, plan reads and
heartbeats must each answer 503 within a bound instead of hanging, say ``database_busy`` for the
frozen database and ``database_unavailable`` for the cut one, and work again once the proxy
forwards again, on the same process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
from sqlalchemy.engine import make_url

from tests.documents import rank_document
from tests.faults.conftest import WORKER
from tests.faults.proxy import TcpProxy

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TIMEOUTS = {
    "KVROUTE_DATABASE_STATEMENT_TIMEOUT_SECONDS": "1",
    "KVROUTE_DATABASE_LOCK_TIMEOUT_SECONDS": "0.5",
    "KVROUTE_DATABASE_CONNECT_TIMEOUT_SECONDS": "1",
    "KVROUTE_READINESS_TIMEOUT_SECONDS": "1",
}
# Client-side: a statement's timeout plus asyncpg's margin, a reconnect, and a loaded machine.
ANSWER_BOUND_S = 10.0
RECOVERY_S = 30.0
RANK = "/v1/deployments/llama/instances/{instance}/ranks/0"
PLAN = "/v1/deployments/llama/plans?sender=ctx0&receiver=gen0&receiver_rank=0"


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    started = TcpProxy().start()
    yield started
    started.stop()


async def _call(session: aiohttp.ClientSession, method: str, url: str, **kwargs: object):
    started = time.monotonic()
    async with session.request(method, url, **kwargs) as response:
        body = await response.json(content_type=None)
        return (
            response.status,
            response.headers.get("Retry-After"),
            body,
            time.monotonic() - started,
        )


def _requests(base: str) -> list[tuple[str, str, dict[str, object]]]:
    document = rank_document(role="context")
    return [
        ("PUT", base + RANK.format(instance="ctx0"), {"json": document}),
        ("GET", base + PLAN, {}),
        ("POST", base + RANK.format(instance="ctx0") + "/heartbeat", {}),
    ]


async def _all_refused(base: str, code: str) -> None:
    async with aiohttp.ClientSession(headers=WORKER) as session:
        answers = await asyncio.gather(
            *(_call(session, method, url, **kwargs) for method, url, kwargs in _requests(base)),
            _call(session, "GET", base + "/readyz"),
        )
    *work, ready = answers
    for status, retry_after, body, seconds in work:
        assert status == 503, body
        assert body["code"] == code
        assert retry_after is not None
        assert seconds < ANSWER_BOUND_S
    assert (ready[0], ready[1]) == (503, "1")
    assert ready[3] < ANSWER_BOUND_S


async def _recovers(base: str) -> None:
    async with aiohttp.ClientSession(headers=WORKER) as session:
        deadline = time.monotonic() + RECOVERY_S
        while time.monotonic() < deadline:
            if (await _call(session, "GET", base + "/readyz"))[0] == 200:
                break
            await asyncio.sleep(0.2)
        for method, url, kwargs in _requests(base):
            status, _, body, _ = await _call(session, method, url, **kwargs)
            assert status == 200, body


def test_frozen_then_cut_postgres_answers_503_in_time_and_recovers(
    servers, postgres_test_url, proxy
) -> None:
    through_proxy = make_url(postgres_test_url).set(port=proxy.port)
    server = servers(through_proxy.render_as_string(hide_password=False), **TIMEOUTS)
    asyncio.run(_register(server.url))

    proxy.freeze()
    asyncio.run(_all_refused(server.url, "database_busy"))
    proxy.resume()
    asyncio.run(_recovers(server.url))

    proxy.cut()
    asyncio.run(_all_refused(server.url, "database_unavailable"))
    proxy.resume()
    asyncio.run(_recovers(server.url))
    assert server.process is not None
    assert server.process.poll() is None  # never restarted


async def _register(base: str) -> None:
    async with aiohttp.ClientSession(headers=WORKER) as session:
        for role, instance in (("context", "ctx0"), ("generation", "gen0")):
            url = base + RANK.format(instance=instance)
            status, _, body, _ = await _call(session, "PUT", url, json=rank_document(role=role))
            assert status == 201, body
        status, _, body, _ = await _call(session, "GET", base + PLAN)
        assert status == 200, body
