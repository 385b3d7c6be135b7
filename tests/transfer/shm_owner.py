"""A worker process that owns shared-memory pool segments, as a real context/generation rank does.

Runs under multiprocessing "spawn": it creates each segment (a named /dev/shm file, or a memfd that
kvroute reaches through this process's /proc/<pid>/fd), fills it with seeded bytes, and frees its
segments when told to stop (and reports a segment's digest, to show kvroute's writes reached it),
so the kvroute side (the test process) only ever attaches.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
from multiprocessing.queues import Queue
from multiprocessing.shared_memory import SharedMemory

import numpy as np


def seeded_bytes(seed: int, size: int) -> np.ndarray:
    """The bytes an owner process writes into a segment; the test regenerates them to compare."""
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def serve(commands: Queue, replies: Queue) -> None:
    owned: dict[str, SharedMemory] = {}
    memfds: dict[int, str] = {}
    while True:
        command, *args = commands.get()
        if command == "create":
            name, size, seed, content = args  # content: the bytes to hold instead of seeded ones
            segment = SharedMemory(name=name, create=True, size=size)
            segment.buf[:size] = (
                content if content is not None else seeded_bytes(seed, size).tobytes()
            )
            owned[name] = segment
            replies.put(("created", name))
        elif command == "digest":
            (name,) = args
            replies.put(("digest", hashlib.sha256(owned[name].buf).hexdigest()))
        elif command == "truncate":
            # The worker shrinks its own segment (same file, same name) under kvroute's mapping.
            name, size = args
            os.truncate(f"/dev/shm/{name}", size)
            replies.put(("truncated", name))
        elif command == "unlink":
            (name,) = args
            segment = owned.pop(name)
            segment.close()
            segment.unlink()
            replies.put(("unlinked", name))
        elif command == "memfd":
            # seals: names of fcntl.F_SEAL_* constants to add after sizing it
            name, size, seed, seals = args
            flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals is not None else 0)
            fd = os.memfd_create(name, flags)
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as mapping:
                mapping[:size] = seeded_bytes(seed, size).tobytes()
            for seal in seals or ():
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, getattr(fcntl, seal))
            memfds[fd] = name
            replies.put(("memfd", os.getpid(), fd))
        elif command == "memfd_truncate":
            # The worker tries to shrink its own memfd: a sealed one refuses (EPERM).
            fd, size = args
            try:
                os.ftruncate(fd, size)
            except OSError as error:
                replies.put(("refused", error.errno))
            else:
                replies.put(("truncated", fd))
        elif command == "memfd_digest":
            (fd,) = args
            with mmap.mmap(fd, os.fstat(fd).st_size) as mapping:
                replies.put(("digest", hashlib.sha256(mapping).hexdigest()))
        elif command == "memfd_close":
            (fd,) = args
            memfds.pop(fd)
            os.close(fd)
            replies.put(("closed", fd))
        elif command == "stop":
            for segment in owned.values():
                segment.close()
                segment.unlink()
            replies.put(("stopped",))
            return
