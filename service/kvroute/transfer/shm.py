"""POSIX shared-memory pools, opened by name without taking ownership, re-checked before every use.

A worker creates its pool segment and registers the name; kvroute maps the segment read-write and
never unlinks it. The segment is opened straight from ``/dev/shm`` with ``mmap`` rather than through
``multiprocessing.shared_memory``: on Python 3.11 attaching with ``SharedMemory`` registers the
segment with this process's resource tracker, which unlinks the *worker's* segment when kvroute
exits. Names are restricted to a safe alphabet and opened with ``O_NOFOLLOW`` so a registration can
never reach outside the shared-memory directory.

Which segments: only a regular file whose name starts with ``name_prefix`` and whose owner is one of
``owners`` (``KVROUTE_SHM_NAME_PREFIX``, ``KVROUTE_SHM_OWNER_UIDS``). kvroute cannot see which
process registered a pool, so this is what "the worker's own segment" means; it keeps other users'
files and other software's segments (PostgreSQL's ``PostgreSQL.*``) out of reach even where
kvroute's privileges would let it open them.

Why re-check: a mapped file that shrinks under its mapping raises SIGBUS on the next touch of the
pages past its end, and SIGBUS kills the whole server. The open file descriptor is kept with the
mapping, and ``verify`` checks, through it, type, owner and size against the pool (and that the name
still leads to the same file, so a restarted worker's new segment is never written through the dead
mapping). ``PoolMemoryCache`` verifies a cached mapping each time a job opens it, and the worker pool
verifies every pool of a job again right before copying, on the worker thread, so a job only ever
touches a mapping it checked itself. What no check can close is a worker shrinking its segment while a
copy into it is running: a mapping cannot be protected against its own file (only sealed memfds
can), so that worker can still fault kvroute; the window is the copy itself.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError
from kvroute.transfer.memory import Descriptor, PoolMemory, check_extent, descriptor_offset

SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}", re.ASCII)
SHM_ROOT = Path("/dev/shm")
DEFAULT_NAME_PREFIX = "kvroute-"  # kvroute.settings' default of KVROUTE_SHM_NAME_PREFIX


class ShmBackend:
    name = "shm"

    def __init__(
        self,
        root: Path = SHM_ROOT,
        *,
        name_prefix: str = DEFAULT_NAME_PREFIX,
        owners: Collection[int] | None = None,
    ) -> None:
        self._root = root
        self._prefix = name_prefix
        self._owners = frozenset(owners) if owners is not None else frozenset({os.geteuid()})

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        name = self._segment_name(descriptor, pool)
        offset = descriptor_offset(descriptor, pool, self.name)
        fd = self._open_fd(name, pool)
        try:
            info = self._check(fd, name, offset, pool)
            mapping = mmap.mmap(fd, offset + pool.size_bytes)
        except BaseException:
            os.close(fd)
            raise
        segment = _Segment(self, name, fd, (info.st_dev, info.st_ino), offset, pool)
        # Through numpy, not torch.frombuffer: numpy holds a buffer export for as long as any tensor
        # view lives, so the mapping can never be closed under a running copy (torch.frombuffer
        # keeps no export and would leave dangling pointers).
        array = np.frombuffer(mapping, dtype=np.uint8, count=pool.size_bytes, offset=offset)
        tensor = torch.from_numpy(array)

        def release() -> None:
            segment.close()
            try:
                mapping.close()
            except BufferError as error:
                # A caller still holds a view of the pool; the mapping then lives until it is dropped.
                raise PoolMemoryError(
                    pool.pool_id, self.name, f"segment {name!r} is still in use, not unmapped"
                ) from error

        return PoolMemory(pool, self.name, tensor, release, segment.verify)

    def _segment_name(self, descriptor: Descriptor, pool: Pool) -> str:
        segment = descriptor.get("name")
        if (
            not isinstance(segment, str)
            or not SHM_NAME.fullmatch(segment)
            or segment in {".", ".."}
        ):
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"segment name {segment!r} must match {SHM_NAME.pattern} and not be '.' or '..'",
            )
        if not segment.startswith(self._prefix):
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"segment name {segment!r} does not start with {self._prefix!r}, the prefix this "
                "kvroute opens (KVROUTE_SHM_NAME_PREFIX)",
            )
        return segment

    def _open_fd(self, segment: str, pool: Pool) -> int:
        try:
            return os.open(self._root / segment, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"no shared memory segment named {segment!r}"
            ) from error
        except OSError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"cannot open segment {segment!r}: {error.strerror}"
            ) from error

    def _check(self, fd: int, segment: str, offset: int, pool: Pool) -> os.stat_result:
        """Type, owner and size of the open segment; raises ``PoolMemoryError`` naming what is off."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PoolMemoryError(pool.pool_id, self.name, f"{segment!r} is not a segment")
        if info.st_uid not in self._owners:
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"segment {segment!r} is owned by uid {info.st_uid}, not by a worker uid this "
                f"kvroute trusts ({', '.join(map(str, sorted(self._owners)))}; "
                "KVROUTE_SHM_OWNER_UIDS)",
            )
        try:
            check_extent(info.st_size, offset, pool, self.name)
        except PoolMemoryError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"segment {segment!r}: {error.reason}"
            ) from None
        return info


class _Segment:
    """The open descriptor behind one mapping: re-checked through it, closed once, never reused."""

    def __init__(
        self,
        backend: ShmBackend,
        name: str,
        fd: int,
        identity: tuple[int, int],
        offset: int,
        pool: Pool,
    ) -> None:
        self._backend = backend
        self._name = name
        self._fd: int | None = fd
        self._identity = identity
        self._offset = offset
        self._pool = pool
        # A closed descriptor's number may be reused by another file: check and close exclusively.
        self._lock = threading.Lock()

    def verify(self) -> None:
        pool, backend = self._pool, self._backend
        with self._lock:
            if self._fd is None:
                raise PoolMemoryError(
                    pool.pool_id, backend.name, f"segment {self._name!r} was closed"
                )
            backend._check(self._fd, self._name, self._offset, pool)
        # A worker that restarts re-creates its segment under the same name: writes into the old
        # mapping would land in an unlinked segment nobody reads, and the job would "succeed".
        try:
            now = os.stat(backend._root / self._name, follow_symlinks=False)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != self._identity:
            raise PoolMemoryError(
                pool.pool_id, backend.name, f"segment {self._name!r} was removed or re-created"
            )

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A stale mapping dropped from the cache (and from the last job holding it) goes here.
        self.close()
