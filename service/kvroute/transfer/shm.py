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
copy into it is running: a mapping cannot be protected against its own file, so that worker can still
fault kvroute; the window is the copy itself. That is why plain segments are the opt-in: the default
pools of ``kvroute.client`` are sealed memfds (``memfd``), which cannot shrink at all.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection
from pathlib import Path

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError
from kvroute.transfer.mapped import Identity, Segment, exhausted, map_descriptor
from kvroute.transfer.memory import Descriptor, PoolMemory, check_extent, descriptor_offset

SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}", re.ASCII)
SHM_ROOT = Path("/dev/shm")
DEFAULT_NAME_PREFIX = "kvroute-"  # kvroute.settings' default of KVROUTE_SHM_NAME_PREFIX


class TrustedFiles:
    """What a backend of worker-created files (``shm``, ``memfd``) trusts: a name that starts with
    this kvroute's prefix, a worker uid as owner, and the pool's whole extent in the file."""

    name: str

    def __init__(
        self, *, name_prefix: str = DEFAULT_NAME_PREFIX, owners: Collection[int] | None = None
    ) -> None:
        self._prefix = name_prefix
        self._owners = frozenset(owners) if owners is not None else frozenset({os.geteuid()})

    # How errors name a file (``where`` fills the braces), and what its absence means.
    file_named: str
    absent: str

    def _open(self, path: Path, flags: int, where: str, pool: Pool) -> int:
        """``path`` opened read-write with ``flags`` added."""
        what = self.file_named.format(where)
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC | flags)
        except FileNotFoundError as error:
            raise PoolMemoryError(pool.pool_id, self.name, self.absent.format(where)) from error
        except OSError as error:
            raise exhausted(error, f"opening {what}") or PoolMemoryError(
                pool.pool_id, self.name, f"cannot open {what}: {error.strerror}"
            ) from error

    def _check_prefix(self, name: str, what: str, pool: Pool) -> None:
        if not name.startswith(self._prefix):
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"{what} does not start with {self._prefix!r}, the prefix this kvroute opens "
                "(KVROUTE_SHM_NAME_PREFIX)",
            )

    def _check_owner(self, info: os.stat_result, what: str, pool: Pool) -> None:
        if info.st_uid not in self._owners:
            raise PoolMemoryError(
                pool.pool_id,
                self.name,
                f"{what} is owned by uid {info.st_uid}, not by a worker uid this kvroute trusts "
                f"({', '.join(map(str, sorted(self._owners)))}; KVROUTE_SHM_OWNER_UIDS)",
            )

    def _check_size(self, info: os.stat_result, offset: int, what: str, pool: Pool) -> None:
        try:
            check_extent(info.st_size, offset, pool, self.name)
        except PoolMemoryError as error:
            raise PoolMemoryError(pool.pool_id, self.name, f"{what}: {error.reason}") from None


class ShmBackend(TrustedFiles):
    name = "shm"
    file_named, absent = "segment {}", "no shared memory segment named {}"

    def __init__(
        self,
        root: Path = SHM_ROOT,
        *,
        name_prefix: str = DEFAULT_NAME_PREFIX,
        owners: Collection[int] | None = None,
    ) -> None:
        super().__init__(name_prefix=name_prefix, owners=owners)
        self._root = root

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        name = self._segment_name(descriptor, pool)
        offset = descriptor_offset(descriptor, pool, self.name)
        path = self._root / name
        fd = self._open(path, os.O_NOFOLLOW, repr(name), pool)
        segment = Segment(
            self.name,
            pool,
            lambda fd: self._check(fd, name, offset, pool),
            # lstat: the name must lead to the mapped file itself, never through a link
            lambda: _lstat_identity(path),
            f"segment {name!r} was removed or re-created",
        )
        return map_descriptor(fd, offset, segment)

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
        self._check_prefix(segment, f"segment name {segment!r}", pool)
        return segment

    def _check(self, fd: int, segment: str, offset: int, pool: Pool) -> None:
        """Type, owner and size of the open segment; raises ``PoolMemoryError`` naming what is off."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PoolMemoryError(pool.pool_id, self.name, f"{segment!r} is not a segment")
        self._check_owner(info, f"segment {segment!r}", pool)
        self._check_size(info, offset, f"segment {segment!r}", pool)


def _lstat_identity(path: Path) -> Identity | None:
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return info.st_dev, info.st_ino
