"""A clock tests move by hand: leases expire when the test says so, not after real seconds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class ManualClock:
    def __init__(self, start: datetime | None = None) -> None:
        self.time = start or datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += timedelta(seconds=seconds)
