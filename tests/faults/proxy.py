"""A TCP proxy the test controls, in front of the shared PostgreSQL: freeze, cut, resume.

The shared server on 127.0.0.1:5432 must never be stopped, so database faults are played by this
proxy instead: ``freeze`` stops forwarding bytes (connections stay open, as with a server that
hangs), ``cut`` closes every connection and refuses new ones (as with a server or network that went
away), ``resume`` forwards again on the same port. It runs its own event loop in a thread, so a
test can drive it from synchronous code while a live kvroute talks through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

CHUNK = 64 * 1024
CALL_TIMEOUT_S = 10.0


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; every method is safe to call from any thread."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted since start, for tests that want to see traffic

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CALL_TIMEOUT_S)
        self._loop.close()

    def freeze(self) -> None:
        """Stop forwarding in both directions; connections stay open and new ones are accepted."""
        self._call(self._set_flowing(False))

    def cut(self) -> None:
        """Close every connection and the listener: new connections are refused."""
        self._call(self._cut())

    def resume(self) -> None:
        """Forward again (listening again on the same port after a cut)."""
        self._call(self._resume())

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=CALL_TIMEOUT_S)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        await self._listen()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()  # RST, as a dead peer or a dropped route would look
        self._writers.clear()

    async def _resume(self) -> None:
        if self._server is None:
            await self._listen()
        await self._set_flowing(True)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream = await asyncio.open_connection(*self.target)
        except OSError:
            client.transport.abort()
            return
        self._writers.update((client, upstream))
        await asyncio.gather(
            self._pump(client_reader, upstream), self._pump(upstream_reader, client)
        )
        for writer in (client, upstream):
            self._writers.discard(writer)
            writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # bytes read just before a freeze are held, too
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
