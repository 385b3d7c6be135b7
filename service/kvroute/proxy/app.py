"""The proxy's aiohttp application: OpenAI routes, health, and its own engine directory."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvroute.client import AsyncKvrouteClient
from kvroute.proxy.directory import Directory, NoRoute
from kvroute.proxy.handoff import Handoff, _problem

handoff_key = web.AppKey("handoff", Handoff)


def make_app(
    kvroute_url: str,
    deployment: str,
    *,
    token: str | None = None,
    refresh_s: float = 1.0,
    cooldown_s: float = 10.0,
    hold_s: float = 120.0,
    engine_timeout_s: float = 600.0,
) -> web.Application:
    app = web.Application()

    async def lifetime(app: web.Application):  # type: ignore[no-untyped-def]
        client = AsyncKvrouteClient(kvroute_url, token=token, timeout=5.0)
        # connect and first-byte bounds: a dead engine fails fast, a long generation does not
        timeout = aiohttp.ClientTimeout(total=engine_timeout_s, sock_connect=5.0, sock_read=120.0)
        session = aiohttp.ClientSession(timeout=timeout)
        directory = Directory(
            client, deployment, refresh_s=refresh_s, cooldown_s=cooldown_s, hold_s=hold_s
        )
        app[handoff_key] = Handoff(directory, session)
        yield
        await session.close()
        await client.close()

    app.cleanup_ctx.append(lifetime)
    app.router.add_post("/v1/completions", _route("/v1/completions"))
    app.router.add_post("/v1/chat/completions", _route("/v1/chat/completions"))
    app.router.add_get("/healthz", _health)
    return app


def _route(path: str):  # type: ignore[no-untyped-def]
    async def handle(request: web.Request) -> web.StreamResponse:
        return await request.app[handoff_key].serve(request, path)

    return handle


async def _health(request: web.Request) -> web.Response:
    """200 with the pair the next request would take, 503 naming why there is none."""
    directory = request.app[handoff_key].directory
    try:
        producer, consumer = await directory.choose()
    except NoRoute as reason:
        return _problem(503, "no P/D pair available", str(reason))
    return web.json_response(
        {
            "producer": producer.instance,
            "consumer": consumer.instance,
            "producer_url": producer.url,
            "consumer_url": consumer.url,
        }
    )
