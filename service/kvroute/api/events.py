"""``GET /v1/deployments/{d}/events``: the deployment's changes as server-sent events.

Each event is ``id: <revision>``, ``event: <kind>`` and ``data: <Event JSON>``; a comment line
(``: keepalive``) is sent when nothing happened for a while, so proxies and clients see a live
connection. A client resumes from ``?since=<revision>`` or the standard ``Last-Event-ID`` header;
a revision older than the log keeps is 410 ``events_compacted`` before the stream starts.
``?follow=false`` ends the stream once it has sent the events up to the log's revision at the
request, ``?timeout=<seconds>`` after that long: bounded forms a test or a ``curl`` can wait for.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from kvroute import wire
from kvroute.api.keys import event_hub_key, validated_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.control.events import EventsCompacted

RETRY_MS = 1000  # how long an EventSource waits before reconnecting


async def stream_events(request: web.Request) -> web.StreamResponse:
    validated = request[validated_key]
    deployment = validated.path["deployment"]
    since = validated.query.get("since", _last_event_id(request))
    follow = validated.query.get("follow", True)
    try:
        watch = await request.app[event_hub_key].open(deployment, since, follow=follow)
    except EventsCompacted as error:
        raise ProblemError(Problem(410, "Gone", str(error), error.code)) from error
    bound = asyncio.timeout(validated.query.get("timeout"))  # None: no deadline
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: pass each event on at once
        }
    )
    try:
        async with bound:
            await response.prepare(request)
            # The revision watched from, so a client can resume from it before any event arrives.
            await response.write(f"retry: {RETRY_MS}\n: revision {watch.cursor}\n\n".encode())
            async for event in watch:
                await response.write(_frame(event))
    except ConnectionResetError:
        pass  # the watcher went away
    except TimeoutError:
        if not bound.expired():
            raise
    finally:
        watch.close()
    return response


def _last_event_id(request: web.Request) -> int | None:
    """The ``Last-Event-ID`` header (an EventSource's reconnect) when it is a revision."""
    value = request.headers.get("Last-Event-ID", "")
    return int(value) if value.isascii() and value.isdigit() and len(value) < 19 else None


def _frame(event: wire.Event | None) -> bytes:
    if event is None:
        return b": keepalive\n\n"
    body = json.dumps(wire.to_json(event), separators=(",", ":"))
    return f"id: {event.revision}\nevent: {event.kind}\ndata: {body}\n\n".encode()
