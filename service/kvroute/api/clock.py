"""The app's clock: every handler, the reaper and the transfer service read time through it.

``create_app(settings, clock=...)`` takes any zero-argument callable returning an aware UTC
``datetime`` (the system clock by default), so tests move time forward instead of sleeping
through leases.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from aiohttp import web

Clock = Callable[[], datetime]
clock_key: web.AppKey[Clock] = web.AppKey("clock")


def system_clock() -> datetime:
    return datetime.now(UTC)


def app_now(app: web.Application) -> datetime:
    """The app's current time."""
    return app[clock_key]()
