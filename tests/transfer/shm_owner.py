"""A worker process that owns shared-memory pool segments, as a real context/generation rank does.

Runs under multiprocessing "spawn": it creates each segment, fills it with seeded bytes, and unlinks
its segments when told to stop (and reports a segment's digest, to show kvroute's writes reached it), so the kvroute side (the test process) only ever attaches.
"""

from __future__ import annotations

import hashlib
import os
from multiprocessing.queues import Queue
from multiprocessing.shared_memory import SharedMemory

from tests.transfer.layouts import seeded_bytes


def serve(commands: Queue, replies: Queue) -> None:
    owned: dict[str, SharedMemory] = {}
    while True:
        command, *args = commands.get()
        if command == "create":
            name, size, seed = args
            segment = SharedMemory(name=name, create=True, size=size)
            segment.buf[:size] = seeded_bytes(seed, size).tobytes()
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
        elif command == "stop":
            for segment in owned.values():
                segment.close()
                segment.unlink()
            replies.put(("stopped",))
            return
