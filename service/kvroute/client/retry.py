"""Bounded retries with exponential backoff and full jitter, honouring ``Retry-After``.

Only what cannot be a wrong answer is retried: no answer at all (connection refused or reset) and
the two statuses kvroute uses for "not now" — 429 (transfer queue full) and 503 (draining, database
unreachable). Jitter keeps a fleet of workers that lost kvroute together from reconnecting in
lockstep when it comes back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_STATUSES = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` counts the first try; delays grow ``base * 2**n`` up to ``max_delay``."""

    attempts: int = 5
    base_delay: float = 0.1
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError("need 0 <= base_delay <= max_delay")

    def delay(
        self, retry: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``retry`` (0-based).

        The server's ``Retry-After`` is a floor (it knows when it will have room), capped by
        ``max_delay`` so a confused server cannot park a worker for an hour.
        """
        ceiling = min(self.max_delay, self.base_delay * 2**retry)
        jittered = (rng or random).uniform(0, ceiling)
        if retry_after is not None:
            return min(self.max_delay, max(jittered, retry_after))
        return jittered


NO_RETRY = RetryPolicy(attempts=1)


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date (RFC 9110 10.2.3); None if absent/bad."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
