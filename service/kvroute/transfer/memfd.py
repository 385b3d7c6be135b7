"""Sealed memfd pools: a worker's anonymous memory that cannot shrink, reached through its fd table.

A plain ``/dev/shm`` segment can be truncated by its owner while kvroute copies through a mapping of
it, and the copy's next touch past the new end raises SIGBUS, which kills the server. A memfd created
with ``MFD_ALLOW_SEALING`` and sealed with ``F_SEAL_SHRINK`` cannot be made smaller by anyone, its
owner included (``ftruncate`` fails with EPERM), so no copy can ever fault on it. kvroute accepts such
a pool only after ``F_GET_SEALS`` on its own descriptor shows the seal, and refuses one that is also
sealed against writes (kvroute writes into receivers' pools).

The descriptor names the owner's process and descriptor number (``{"backend": "memfd", "pid": ...,
"fd": ..., "offset": ...}``); kvroute opens ``/proc/<pid>/fd/<fd>``, which gives it its own open file
of the same memfd (the kernel allows this to the owner's uid). As for shm segments, only a memfd whose
name starts with ``KVROUTE_SHM_NAME_PREFIX`` and whose owner is one of ``KVROUTE_SHM_OWNER_UIDS`` is
opened, and every job re-checks that the owner still holds that very memfd under that number: a
worker that closed its pool, exited or restarted fails the job instead of feeding a dead mapping.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError
from kvroute.transfer.mapped import Segment, identity_of, map_descriptor
from kvroute.transfer.memory import Descriptor, PoolMemory, descriptor_offset
from kvroute.transfer.shm import TrustedFiles

PROC = Path("/proc")
MEMFD_LINK = "/memfd:"  # readlink of a memfd: "/memfd:<name> (deleted)"
WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


class MemfdBackend(TrustedFiles):
    name = "memfd"
    file_named, absent = "the memfd at {}", "no process holds a descriptor at {}"
    _proc = PROC

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        pid = self._number(descriptor, "pid", 1, pool)
        number = self._number(descriptor, "fd", 0, pool)
        offset = descriptor_offset(descriptor, pool, self.name)
        where = f"pid {pid} fd {number}"
        path = self._proc / str(pid) / "fd" / str(number)
        fd = self._open(path, 0, where, pool)
        segment = Segment(
            self.name,
            pool,
            lambda fd: self._check(fd, where, offset, pool),
            lambda: identity_of(path),
            f"the memfd at {where} was closed or replaced by its owner",
        )
        return map_descriptor(fd, offset, segment)

    def _number(self, descriptor: Descriptor, key: str, low: int, pool: Pool) -> int:
        value = descriptor.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"{key} must be an integer >= {low}, got {value!r}"
            )
        return value

    def _check(self, fd: int, where: str, offset: int, pool: Pool) -> None:
        """A memfd of a trusted owner, sealed against shrinking, writable, large enough."""
        info = os.fstat(fd)
        link = os.readlink(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(info.st_mode) or not link.startswith(MEMFD_LINK):
            raise PoolMemoryError(pool.pool_id, self.name, f"{where} is not a memfd ({link!r})")
        memfd_name = link.removeprefix(MEMFD_LINK).removesuffix(" (deleted)")
        self._check_prefix(memfd_name, f"memfd {memfd_name!r} at {where}", pool)
        self._check_owner(info, f"memfd at {where}", pool)
        self._check_seals(fd, where, pool)
        self._check_size(info, offset, where, pool)

    def _check_seals(self, fd: int, where: str, pool: Pool) -> None:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"cannot read the seals of {where}: {error.strerror}"
            ) from error
        if not seals & fcntl.F_SEAL_SHRINK:
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"memfd at {where} is not sealed against shrinking (F_SEAL_SHRINK): its owner "
                "could truncate it under a running copy; create it with MFD_ALLOW_SEALING and "
                "add the seal, or register a plain shm segment",
            )
        if seals & WRITE_SEALS:
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"memfd at {where} is sealed against writes; kvroute writes into pools",
            )
