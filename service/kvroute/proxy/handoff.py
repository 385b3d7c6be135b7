"""One request through a P/D pair: prefill on the producer, the rest on the consumer.

The producer gets the request with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true}`` and answers the handover in its ``kv_transfer_params``; the consumer
gets the original request with those parameters and pulls the prompt's KV through kvroute. A
producer that cannot be reached is skipped for another; a consumer that fails before sending a
byte is retried on another consumer (the producer holds the blocks until one pulls them or its
``send_timeout_s`` ends); once a stream has started, a failure ends it with an error event. An
engine's error answer is passed on with its status, never turned into a success.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.proxy.directory import Directory, Engine, NoRoute

ATTEMPTS = 2  # producers (or consumers) tried before the request fails


class EngineFailed(Exception):
    def __init__(self, engine: Engine, detail: str, status: int = 502) -> None:
        super().__init__(f"{engine.instance} ({engine.url}): {detail}")
        self.engine, self.status = engine, status


@dataclass
class Handoff:
    directory: Directory
    session: aiohttp.ClientSession

    async def serve(self, request: web.Request, path: str) -> web.StreamResponse:
        body = await _json_body(request)
        tried: set[str] = set()
        for _ in range(ATTEMPTS):
            try:
                producer, consumer = await self.directory.choose(frozenset(tried))
            except NoRoute as reason:
                return _problem(503, "no P/D pair available", str(reason))
            try:
                params = await self._prefill(producer, path, body)
            except EngineFailed as failed:
                tried.add(failed.engine.instance)
                last = failed
                continue
            try:
                return await self._decode(request, consumer, path, body, params)
            except EngineFailed as failed:
                tried.add(failed.engine.instance)
                last = failed
        return _problem(last.status, "the P/D pair failed", str(last))

    async def _prefill(self, producer: Engine, path: str, body: Mapping[str, Any]) -> Any:
        prefill = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        for key in ("max_completion_tokens", "stream_options"):
            prefill.pop(key, None)
        self.directory.busy[producer.instance] += 1
        try:
            async with self.session.post(producer.url + path, json=prefill) as answer:
                payload = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            self.directory.unreachable(producer.instance)
            raise EngineFailed(producer, f"unreachable ({error!r})") from error
        finally:
            self.directory.busy[producer.instance] -= 1
        if answer.status != 200:
            raise EngineFailed(producer, f"prefill answered {answer.status}: {payload[:300]!r}")
        params = json.loads(payload).get("kv_transfer_params")
        if not params:
            raise EngineFailed(
                producer, "its answer has no kv_transfer_params (no kvroute producer?)"
            )
        return params

    async def _decode(
        self,
        request: web.Request,
        consumer: Engine,
        path: str,
        body: Mapping[str, Any],
        params: Any,
    ) -> web.StreamResponse:
        self.directory.busy[consumer.instance] += 1
        try:
            async with self.session.post(
                consumer.url + path, json={**body, "kv_transfer_params": params}
            ) as answer:
                if answer.status != 200 or not body.get("stream"):
                    payload = await answer.read()
                    if answer.status >= 500:
                        raise EngineFailed(consumer, f"answered {answer.status}: {payload[:300]!r}")
                    return web.Response(
                        status=answer.status,
                        body=payload,
                        content_type=answer.content_type,
                        headers=_pair(params, consumer),
                    )
                return await _relay(request, answer, consumer, _pair(params, consumer))
        except (aiohttp.ClientError, TimeoutError) as error:
            self.directory.unreachable(consumer.instance)
            raise EngineFailed(consumer, f"unreachable ({error!r})") from error
        finally:
            self.directory.busy[consumer.instance] -= 1


def _pair(params: Any, consumer: Engine) -> dict[str, str]:
    """Which engines served the request (for operators and tests): the producer is the instance
    its hand-over names."""
    producer = params.get("remote_instance", "") if isinstance(params, dict) else ""
    return {"X-Kvroute-Producer": str(producer), "X-Kvroute-Consumer": consumer.instance}


async def _relay(
    request: web.Request,
    answer: aiohttp.ClientResponse,
    consumer: Engine,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Streams the consumer's server-sent events through; a failure after the first byte ends the
    stream with an error event (the client has seen tokens: it cannot be retried silently)."""
    first = await answer.content.readany()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await response.prepare(request)
    await response.write(first)
    try:
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
    except (aiohttp.ClientError, TimeoutError) as error:
        event = {"error": {"message": f"consumer {consumer.instance} failed mid-stream: {error!r}"}}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def _problem(status: int, title: str, detail: str) -> web.Response:
    return web.json_response(
        {"type": "about:blank", "title": title, "status": status, "detail": detail},
        status=status,
        content_type="application/problem+json",
    )
