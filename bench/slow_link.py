"""A TCP proxy that delays every byte by a fixed time each way: a database a network hop away.

On this machine PostgreSQL answers over loopback in tens of microseconds, so a change that saves
round trips (statements per admission batch) shows nothing here that it would show in production,
where the database sits a zone or a rack away. Put this in front of it and point the bench at it:

    python bench/slow_link.py --listen 6543 --delay-ms 0.5 &
    KVROUTE_BENCH_POSTGRES_URL=postgresql+asyncpg://postgres@127.0.0.1:6543/kvroute_scale_bench \\
        python bench/scale_bench.py --issue22 --configs postgres --phases leases ...

It prints the round trip as measured (``SELECT 1`` direct and through it): the event loop's timers
count whole milliseconds, so 0.5 ms each way adds almost nothing and 1 ms each way adds about 2.2.
Chunks keep their order: each is written ``delay`` after it was read, and reads are sequential.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import asyncpg
import uvloop

CHUNK = 64 * 1024
PROBES = 200


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(CHUNK):
            loop.call_later(delay, _write, writer, data)
    loop.call_later(delay, writer.close)


def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


async def _serve(listen: int, target: tuple[str, int], delay: float) -> asyncio.Server:
    async def accept(client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        upstream_reader, upstream = await asyncio.open_connection(*target)
        await asyncio.gather(
            _pump(client_reader, upstream, delay), _pump(upstream_reader, client, delay)
        )

    return await asyncio.start_server(accept, "127.0.0.1", listen)


async def _round_trip_ms(port: int) -> float:
    connection = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres")
    try:
        samples = []
        for _ in range(PROBES):
            started = time.perf_counter()
            await connection.fetchval("SELECT 1")
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)
    finally:
        await connection.close()


async def main(args: argparse.Namespace) -> None:
    server = await _serve(args.listen, (args.host, args.port), args.delay_ms / 1000)
    direct = await _round_trip_ms(args.port)
    proxied = await _round_trip_ms(args.listen)
    print(
        f"slow link :{args.listen} -> {args.host}:{args.port}, {args.delay_ms} ms each way "
        f"requested: SELECT 1 median {direct:.3f} ms direct, {proxied:.3f} ms through it",
        flush=True,
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, default=6543)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5432)
    parser.add_argument("--delay-ms", type=float, default=0.5)
    uvloop.run(main(parser.parse_args()))
