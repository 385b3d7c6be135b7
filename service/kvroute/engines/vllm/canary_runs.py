"""A consumer rank's canaries as its pulls run them: one at a time, round by round.

Every canary lands in this rank's block 0, so one runs at a time and the others queue (a newer
one of the same producer replaces a queued one). A round is pulled (``Pulls`` posts it), checked
off the step (``ConsumerChecks``), then the next round follows; the path is reported once, failed
at its first wrong element or attested after the last round, with the rounds' pulls and checks as
its cost. A transport failure ends the canary unreported: the next pairing tries again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvroute.client.kv_digest import Mismatch
from kvroute.engines.vllm.canary import Canary
from kvroute.engines.vllm.digests import ConsumerChecks

log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _Run:
    canary: Canary
    spent_s: float = 0.0  # the rounds' pulls and checks so far
    started: float = 0.0  # the current round's pull
    check: Future[tuple[Mismatch | None, float]] | None = None


@dataclass
class CanaryRuns:
    """The queue and the running canary; each method answers the round to pull next, if any."""

    checks: ConsumerChecks
    queued: list[Canary] = field(default_factory=list)
    run: _Run | None = None

    def add(self, canary: Canary) -> Canary | None:
        self.queued = [waiting for waiting in self.queued if waiting.instance != canary.instance]
        self.queued.append(canary)
        return self._next() if self.run is None else None

    def pulling(self) -> None:
        """The current round's pull is posted now."""
        assert self.run is not None
        self.run.started = time.monotonic()

    def pulled(self, done: bool) -> Canary | None:
        """The current round's pull ended (``done``: every read completed)."""
        run = self.run
        assert run is not None
        if not done:
            return self.ended()
        run.spent_s += time.monotonic() - run.started
        run.check = self.checks.check_canary(run.canary)
        return None

    def checked(self) -> Canary | None:
        """A round whose check finished: the path fails at its first wrong element, is attested
        after the last round, or the next round is pulled."""
        run = self.run
        if run is None or run.check is None or not run.check.done():
            return None
        try:
            failure, check_s = run.check.result()
        except Exception:  # a reader's bug is not the path's failure: said, and not reported
            log.exception("kvroute: checking the canary from %s failed", run.canary.instance)
            return self.ended()
        run.spent_s += check_s
        if failure is not None or run.canary.last:
            self.checks.report_canary(run.canary, failure, run.spent_s)
            return self.ended()
        run.canary, run.check = run.canary.following(), None
        return run.canary

    def ended(self) -> Canary | None:
        self.run = None
        return self._next()

    def idle(self) -> bool:
        return self.run is None and not self.queued

    def _next(self) -> Canary | None:
        if not self.queued:
            return None
        self.run = _Run(self.queued.pop(0))
        return self.run.canary
