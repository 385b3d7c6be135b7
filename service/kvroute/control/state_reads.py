"""Instance states for plan reads, one database read per wave of concurrent requests.

Every plan read, cache hits included, must see the registry as of after it arrived: a plan may
never be older than the request asking for it. Under load, hundreds of such reads per second would
each pay a database round trip. Instead the requests that arrive while one read is in flight wait
for the next read, which starts after all of them arrived and fetches every instance they asked
for in one statement; so each request's answer still comes from a read that began after it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from kvroute.control.waves import Waves
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import NotFound
from kvroute.store.snapshots import InstanceState, instance_states

States = dict[str, InstanceState]
Asked = tuple[frozenset[str], datetime]  # instances, clock reading


class StateReads:
    def __init__(self, sessionmaker: SessionMaker) -> None:
        self._sessionmaker = sessionmaker
        self._waves: Waves[Asked, States] = Waves(self._read, name="state-reads")

    async def states(
        self, deployment: str, instances: Sequence[str], *, now: datetime
    ) -> dict[str, InstanceState]:
        """``instance_states`` of the instances, from a read that started after this call."""
        states = await self._waves.submit(deployment, (frozenset(instances), now))
        missing = [name for name in instances if name not in states]
        if missing:
            raise NotFound(f"instance {missing[0]!r} of deployment {deployment!r} does not exist")
        return {name: states[name] for name in instances}

    async def _read(self, deployment: str, wave: list[Asked]) -> list[States]:
        names = sorted(set().union(*(wanted for wanted, _ in wave)))
        # Leases are judged at the latest clock reading among the wave's requests.
        now = max(at for _, at in wave)
        states = await instance_states(
            self._sessionmaker, deployment, names, now=now, missing_ok=True
        )
        return [states] * len(wave)
