"""A pool mapped from an open file descriptor, as the shm and memfd backends both map theirs.

The descriptor is kept beside the mapping so the backend can re-check the very file it mapped
(``verify``: type, owner, size, seals) and whether the worker still holds that file under the name it
registered (a restarted worker's new segment must never be written through the dead mapping). Both
are released together, once no view of the mapping is left. A process out of descriptors or address
space is ``PoolsExhausted`` (503, retry later), never an ``OSError`` surfacing as a 500.

Python's ``mmap`` keeps a duplicate of the descriptor it maps, so an open pool holds two.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError, PoolsExhausted
from kvroute.transfer.memory import PoolMemory

DESCRIPTORS_PER_MAPPING = 2  # ours, kept to re-check the file, and mmap's own duplicate
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})

Identity = tuple[int, int]  # st_dev, st_ino


def exhausted(error: OSError, what: str) -> PoolsExhausted | None:
    """The refusal for a system out of descriptors or memory; None for any other error."""
    if error.errno in RESOURCE_ERRNOS:
        return PoolsExhausted(f"{what}: {error.strerror}")
    return None


def identity_of(path: str | os.PathLike[str]) -> Identity | None:
    """The file ``path`` leads to now (following a /proc fd link), or None when it is gone."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


@dataclass(frozen=True, slots=True)
class Segment:
    """How a backend checks what it mapped: ``check(fd)`` raises ``PoolMemoryError`` naming what
    is off; ``current()`` is the identity the worker's name leads to now; ``gone`` says what it
    means when that is no longer the mapped file."""

    backend: str
    pool: Pool
    check: Callable[[int], None]
    current: Callable[[], Identity | None]
    gone: str


def map_descriptor(fd: int, offset: int, segment: Segment) -> PoolMemory:
    """Checks and maps ``offset + size_bytes`` of the open file ``fd`` (owned from here on)."""
    pool = segment.pool
    try:
        segment.check(fd)
        info = os.fstat(fd)
        mapping = mmap.mmap(fd, offset + pool.size_bytes)
    except OSError as error:
        os.close(fd)
        raise exhausted(error, "mapping the pool") or PoolMemoryError(
            pool.pool_id, segment.backend, f"cannot map the pool: {error.strerror}"
        ) from error
    except BaseException:
        os.close(fd)
        raise
    held = _Held(segment, fd, (info.st_dev, info.st_ino))
    # Through numpy, not torch.frombuffer: numpy holds a buffer export for as long as any tensor
    # view lives, so the mapping can never be closed under a running copy (torch.frombuffer
    # keeps no export and would leave dangling pointers).
    array = np.frombuffer(mapping, dtype=np.uint8, count=pool.size_bytes, offset=offset)
    tensor = torch.from_numpy(array)

    def release() -> None:
        held.close()
        try:
            mapping.close()
        except BufferError as error:
            # A caller still holds a view of the pool; the mapping then lives until it is dropped.
            raise PoolMemoryError(
                pool.pool_id, segment.backend, "the mapping is still in use, not unmapped"
            ) from error

    return PoolMemory(
        pool, segment.backend, tensor, release, held.verify, descriptors=DESCRIPTORS_PER_MAPPING
    )


class _Held:
    """The open descriptor behind one mapping: re-checked through it, closed once, never reused."""

    def __init__(self, segment: Segment, fd: int, identity: Identity) -> None:
        self._segment = segment
        self._fd: int | None = fd
        self._identity = identity
        # A closed descriptor's number may be reused by another file: check and close exclusively.
        self._lock = threading.Lock()

    def verify(self) -> None:
        segment = self._segment
        with self._lock:
            if self._fd is None:
                raise PoolMemoryError(segment.pool.pool_id, segment.backend, "the pool was closed")
            segment.check(self._fd)
        if segment.current() != self._identity:
            raise PoolMemoryError(segment.pool.pool_id, segment.backend, segment.gone)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A mapping dropped without close() (its last view gone) releases its descriptor here.
        self.close()
