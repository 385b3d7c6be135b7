"""The pools a process has open: shared by the jobs that use them, closed when nothing needs them.

A mapping costs descriptors and pins the segment's memory even after its worker unlinked it, so an
open pool is released as soon as both hold: no queued or running job uses it, and the rank whose
pool it is has re-registered, been deleted or let its lease expire (``retire``: the transfer
service calls it on those events, and sweeps for the ones other replicas saw). Independently of
ranks, at most ``max_open`` pools stay open: opening one more closes the least recently used idle
ones first, and when every open pool is in use by a job, or the system refuses a descriptor or a
mapping, the job is refused with ``PoolsExhausted`` (503, retry later).

Each ``open_pool`` is one use, ended by ``release``: a job holds its pools from acceptance to its
last state. Entries are keyed by the descriptor and the pool's shape, so a re-registration with
another geometry opens a fresh mapping instead of reusing one sized for the old pool.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.geometry import Pool
from kvroute.transfer.backends import default_backends
from kvroute.transfer.errors import PoolMemoryError, PoolsExhausted
from kvroute.transfer.memory import Descriptor, MemoryBackend, PoolMemory

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN = 256  # kvroute.settings' default of KVROUTE_TRANSFER_MAX_OPEN_POOLS


@dataclass(frozen=True, slots=True)
class PoolOwner:
    """The rank a pool was registered by, at the generation a job opened it."""

    deployment: str
    instance: str
    rank: int
    generation: int

    @property
    def rank_key(self) -> tuple[str, str, int]:
        return self.deployment, self.instance, self.rank


@dataclass(eq=False, slots=True)
class _Entry:
    key: str
    memory: PoolMemory
    owner: PoolOwner | None
    users: int = 0
    retired: bool = False  # no longer handed out; closed when its last user releases it


def _cache_key(descriptor: Descriptor, pool: Pool) -> str:
    shape = [pool.pool_id, pool.slot_bytes, pool.slot_stride, pool.num_slots]
    return json.dumps([dict(descriptor), shape], sort_keys=True, default=str)


class PoolMemoryCache:
    """Opens pools through their backends, shares them between jobs; safe from any thread."""

    def __init__(
        self, backends: Sequence[MemoryBackend] | None = None, *, max_open: int = DEFAULT_MAX_OPEN
    ) -> None:
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        if backends is None:
            backends = default_backends()
        self._backends = {backend.name: backend for backend in backends}
        self._max_open = max_open
        self._open: OrderedDict[str, _Entry] = OrderedDict()  # handed out, least recent first
        self._entries: dict[int, _Entry] = {}  # every open memory by id(), retired ones included
        self._lock = threading.Lock()

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def open_pool(
        self, descriptor: Descriptor | None, pool: Pool, owner: PoolOwner | None = None
    ) -> PoolMemory:
        """The pool's open memory, checked now; one use, ended by ``release``."""
        backend = self._backend(descriptor, pool)
        assert descriptor is not None  # _backend refused a pool without memory
        key = _cache_key(descriptor, pool)
        with self._lock:
            if owner is not None:
                self._retire_older(owner)
            entry = self._open.get(key)
            if entry is not None:
                try:
                    entry.memory.verify()  # every job re-checks what it opens, cached or not
                except PoolMemoryError:
                    # Opening again below checks the segment from scratch and names what is wrong.
                    self._retire(entry)
                else:
                    return self._use(entry, owner)
            self._make_room()
            try:
                memory = backend.open(descriptor, pool)
            except PoolsExhausted:
                if not self._close_idle(len(self._open)):
                    raise
                memory = backend.open(descriptor, pool)  # once more, with every idle pool closed
            entry = _Entry(key, memory, owner)
            self._open[key] = entry
            self._entries[id(memory)] = entry
            return self._use(entry, owner)

    def release(self, memories: Iterable[PoolMemory]) -> None:
        """Ends one use of each memory (as often as it was opened); closes retired idle ones."""
        with self._lock:
            for memory in memories:
                entry = self._entries.get(id(memory))
                if entry is None or entry.memory is not memory:
                    continue  # closed with the whole cache
                entry.users -= 1
                if entry.users <= 0 and entry.retired:
                    self._close(entry)

    def retire(self, deployment: str, instance: str, rank: int | None = None) -> int:
        """The pools of a rank (every rank of the instance when None) that was deleted, expired
        or re-registered: closed now where idle, else when their last job ends. Returns how many
        pools were retired."""
        with self._lock:
            doomed = [
                entry
                for entry in self._open.values()
                if entry.owner is not None
                and (entry.owner.deployment, entry.owner.instance) == (deployment, instance)
                and (rank is None or entry.owner.rank == rank)
            ]
            for entry in doomed:
                self._retire(entry)
            return len(doomed)

    def supersede(self, owner: PoolOwner) -> None:
        """The rank re-registered at ``owner.generation``: its older pools are done with."""
        with self._lock:
            self._retire_older(owner)

    def owners(self) -> set[PoolOwner]:
        """The ranks (at their generations) whose pools are open and still handed out."""
        with self._lock:
            return {entry.owner for entry in self._open.values() if entry.owner is not None}

    def retire_owner(self, owner: PoolOwner) -> None:
        """Retires the pools opened for exactly this rank generation (gone or superseded)."""
        with self._lock:
            for entry in [e for e in self._open.values() if e.owner == owner]:
                self._retire(entry)

    @property
    def open_descriptors(self) -> int:
        """File descriptors held by open pools (retired ones still in use included)."""
        with self._lock:
            return sum(entry.memory.descriptors for entry in self._entries.values())

    def close(self) -> None:
        """Release every mapping; call after the worker pool has drained."""
        with self._lock:
            entries, self._entries, self._open = list(self._entries.values()), {}, OrderedDict()
        for entry in entries:
            _close_memory(entry.memory)

    def __len__(self) -> int:
        """Open pools: handed out, or retired but still used by a job."""
        return len(self._entries)

    def __enter__(self) -> PoolMemoryCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- under the lock ------------------------------------------------------------------------

    def _backend(self, descriptor: Descriptor | None, pool: Pool) -> MemoryBackend:
        if descriptor is None:
            raise PoolMemoryError(pool.pool_id, "none", "the pool was registered without memory")
        name = descriptor.get("backend")
        backend = self._backends.get(name) if isinstance(name, str) else None
        if backend is None:
            raise PoolMemoryError(
                pool.pool_id,
                str(name),
                f"unsupported memory backend; this kvroute opens {sorted(self._backends)}",
            )
        return backend

    def _use(self, entry: _Entry, owner: PoolOwner | None) -> PoolMemory:
        entry.users += 1
        if owner is not None:
            entry.owner = owner  # a re-registration naming the same memory keeps the mapping
        self._open.move_to_end(entry.key)
        return entry.memory

    def _retire_older(self, owner: PoolOwner) -> None:
        """A job at a rank's new generation: its pools of older generations are done with."""
        for entry in list(self._open.values()):
            other = entry.owner
            if (
                other is not None
                and other.rank_key == owner.rank_key
                and other.generation < owner.generation
            ):
                self._retire(entry)

    def _retire(self, entry: _Entry) -> None:
        if self._open.get(entry.key) is entry:
            del self._open[entry.key]
        entry.retired = True
        if entry.users <= 0:
            self._close(entry)

    def _make_room(self) -> None:
        """Below ``max_open`` before one more opens: idle pools go, least recently used first."""
        excess = len(self._entries) + 1 - self._max_open
        if excess > 0 and self._close_idle(excess) < excess:
            raise PoolsExhausted(
                f"{len(self._entries)} pools are open and in use by jobs "
                f"(KVROUTE_TRANSFER_MAX_OPEN_POOLS={self._max_open})"
            )

    def _close_idle(self, count: int) -> int:
        idle = [entry for entry in self._open.values() if entry.users <= 0][:count]
        for entry in idle:
            self._retire(entry)
        return len(idle)

    def _close(self, entry: _Entry) -> None:
        self._entries.pop(id(entry.memory), None)
        _close_memory(entry.memory)


def _close_memory(memory: PoolMemory) -> None:
    try:
        memory.close()
    except PoolMemoryError as error:
        log.warning("could not release pool memory: %s", error)
