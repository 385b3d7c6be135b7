"""``kvroute serve``: the REST service on the configured database, with a graceful drain.

The listening socket is bound before anything starts, so a port in use is one line and exit 2
(and "listening" is only logged once the app serves on it); so is a database that cannot be
reached or does not exist. On SIGTERM (or SIGINT):

1. readiness answers 503 at once while every request is still served, for
   ``KVROUTE_DRAIN_SECONDS`` (load balancers and Kubernetes endpoints stop routing here; a second
   signal cuts the drain short);
2. the listener closes, mutations still arriving on open connections answer 503 ``draining``,
   and in-flight requests get up to ``KVROUTE_SHUTDOWN_TIMEOUT_SECONDS``;
3. the transfer pool cancels what is queued and waits the same timeout for running copies (jobs
   still running then are stored failed), the engine is disposed, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
from collections.abc import Callable

from kvroute.cli.common import CommandError, database_errors
from kvroute.cli.variables import settings_epilog
from kvroute.settings import Settings, load_settings

log = logging.getLogger("kvroute.cli")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A full collection after this many middle-generation ones (Python's default: 10). While a fleet
# comes up the registration cache grows by thousands of documents, and at 10 a bring-up of 8,192
# ranks ran 8 full passes of about 120 ms each, every request waiting through each: at 100 the
# registrations' p99 fell from 50-142 ms to 33-41 ms (three runs each, bench/scale_bench.py). Most
# garbage is freed by reference counts; what only a full pass frees waits ten times longer.
FULL_PASS_EVERY = 100


def _serve(args: argparse.Namespace) -> int:
    from kvroute.api.access import configure_logging

    overrides = {
        key: value for key in ("host", "port") if (value := getattr(args, key)) is not None
    }
    settings = load_settings(**overrides)
    configure_logging(log_format=settings.log_format, level=settings.log_level)
    new_loop = loop_factory(settings.event_loop)
    # Bound first: a port in use is refused before any migration runs or anything is logged.
    listener = bind(settings.host, settings.port)
    with contextlib.closing(listener):
        with database_errors(settings.database_url):
            prepare_schema(settings)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(serve(settings, listener))
    return 0


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop (``None``: asyncio's own). uvloop runs the sockets and the loop itself
    in C, which cuts the server's CPU per request; asyncio's loop is there for platforms without
    uvloop and for debugging."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise CommandError(
            "KVROUTE_EVENT_LOOP=uvloop, but uvloop is not installed; install kvroute[server] "
            "(uvloop has no Windows build) or set KVROUTE_EVENT_LOOP=asyncio"
        ) from None
    return uvloop.new_event_loop


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a ``CommandError`` that says why it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as error:
        raise CommandError(f"cannot listen on {host}:{port}: {error}; check KVROUTE_HOST") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        hint = {
            errno.EADDRINUSE: "another process listens there; stop it or choose another "
            "KVROUTE_PORT (--port)",
            errno.EACCES: "ports below 1024 need privileges; choose another KVROUTE_PORT (--port)",
            errno.EADDRNOTAVAIL: "no interface of this host has that address; check KVROUTE_HOST",
        }.get(error.errno or 0, "check KVROUTE_HOST and KVROUTE_PORT")
        raise CommandError(f"cannot listen on {host}:{port}: {error.strerror}; {hint}") from None
    listener.setblocking(False)
    return listener


async def serve(settings: Settings, listener: socket.socket) -> None:
    """Serve on ``listener`` until a stop signal, then drain (see the module docstring)."""
    from aiohttp import web

    from kvroute.api import create_app
    from kvroute.api.keys import lifecycle_key

    app = create_app(settings)
    runner = web.AppRunner(
        app,
        access_log=None,  # kvroute's access middleware writes the one line per request
        shutdown_timeout=settings.shutdown_timeout_seconds,
    )
    stops = _stop_signals()
    await runner.setup()
    try:
        await web.SockSite(runner, listener).start()
        # Everything built so far (modules, the parsed spec, SQLAlchemy's metadata, a few hundred
        # thousand objects) lives as long as the process: keep it out of the cyclic collector's
        # full passes, which otherwise stall every request for a few hundred milliseconds.
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_PASS_EVERY)
        host, port = listener.getsockname()[:2]
        loop = type(asyncio.get_running_loop())
        log.info("kvroute listening on %s:%d (event loop: %s)", host, port, loop.__module__)
        await stops.get()
        app[lifecycle_key].draining = True
        log.info(
            "draining for %gs: readiness is 503, requests are still served",
            settings.drain_seconds,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(settings.drain_seconds):
                await stops.get()  # a second signal ends the drain early
                log.info("second stop signal: ending the drain now")
    finally:
        await runner.cleanup()
        for stop in STOP_SIGNALS:
            asyncio.get_running_loop().remove_signal_handler(stop)
    log.info("kvroute stopped")


def _stop_signals() -> asyncio.Queue[int]:
    stops: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for stop in STOP_SIGNALS:
        loop.add_signal_handler(stop, stops.put_nowait, stop)
    return stops


def prepare_schema(settings: Settings) -> None:
    """Embedded SQLite is upgraded in place; a shared PostgreSQL must be migrated explicitly."""
    from kvroute.store import migrate

    if settings.is_sqlite:
        migrate.upgrade(settings.database_url)
        return
    if not migrate.is_current(settings.database_url):
        raise CommandError(
            f"the database schema is at {migrate.current(settings.database_url) or 'no revision'}, "
            f"not {migrate.head()}: run `kvroute db upgrade` first"
        )


def add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the REST service",
        epilog=settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", help="bind address (default: KVROUTE_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default: KVROUTE_PORT or 8080)")
    parser.set_defaults(run=_serve)
