"""POSIX shared-memory pools, opened by name without taking ownership.

A worker creates its pool segment and registers the name; kvroute maps the segment read-write and
never unlinks it. The segment is opened straight from ``/dev/shm`` with ``mmap`` rather than through
``multiprocessing.shared_memory``: on Python 3.11 attaching with ``SharedMemory`` registers the
segment with this process's resource tracker, which unlinks the *worker's* segment when kvroute
exits. Names are restricted to a safe alphabet and opened with ``O_NOFOLLOW`` so a registration can
never reach outside the shared-memory directory.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from pathlib import Path

import numpy as np
import torch

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError
from kvroute.transfer.memory import Descriptor, PoolMemory, check_extent, descriptor_offset

SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SHM_ROOT = Path("/dev/shm")


class ShmBackend:
    name = "shm"

    def __init__(self, root: Path = SHM_ROOT) -> None:
        self._root = root

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        segment = self._segment_name(descriptor, pool)
        offset = descriptor_offset(descriptor, pool, self.name)
        mapping, identity = self._map(segment, offset, pool)
        # Through numpy, not torch.frombuffer: numpy holds a buffer export for as long as any tensor
        # view lives, so the mapping can never be closed under a running copy (torch.frombuffer
        # keeps no export and would leave dangling pointers).
        array = np.frombuffer(mapping, dtype=np.uint8, count=pool.size_bytes, offset=offset)
        tensor = torch.from_numpy(array)

        def release() -> None:
            try:
                mapping.close()
            except BufferError as error:
                # A caller still holds a view of the pool; the mapping then lives until it is dropped.
                raise PoolMemoryError(
                    pool.pool_id, self.name, f"segment {segment!r} is still in use, not unmapped"
                ) from error

        path = self._root / segment

        def current() -> bool:
            # A worker that restarts re-creates its segment under the same name: writes into the
            # old mapping would land in an unlinked segment nobody reads, and the job would "succeed".
            try:
                info = os.stat(path, follow_symlinks=False)
            except OSError:
                return False
            return (info.st_dev, info.st_ino) == identity

        return PoolMemory(pool, self.name, tensor, release, current)

    def _segment_name(self, descriptor: Descriptor, pool: Pool) -> str:
        segment = descriptor.get("name")
        if not isinstance(segment, str) or not SHM_NAME.match(segment) or segment in {".", ".."}:
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"segment name {segment!r} must match {SHM_NAME.pattern} and not be '.' or '..'",
            )
        return segment

    def _map(self, segment: str, offset: int, pool: Pool) -> tuple[mmap.mmap, tuple[int, int]]:
        try:
            fd = os.open(self._root / segment, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"no shared memory segment named {segment!r}"
            ) from error
        except OSError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"cannot open segment {segment!r}: {error.strerror}"
            ) from error
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PoolMemoryError(pool.pool_id, self.name, f"{segment!r} is not a segment")
            check_extent(info.st_size, offset, pool, self.name)
            return mmap.mmap(fd, offset + pool.size_bytes), (info.st_dev, info.st_ino)
        finally:
            os.close(fd)
