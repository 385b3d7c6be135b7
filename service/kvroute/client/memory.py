"""Pool memory a kvroute process can open: sealed memfds, POSIX shared memory, CUDA IPC handles.

The descriptors follow ``kvroute.transfer``'s conventions exactly (``memfd``: this process's id and
the memfd's descriptor number; ``shm``: a segment name under /dev/shm; both with the offset of slot
0; ``cuda_ipc``: the allocation's IPC handle, device, offset and size), so what a worker registers is
what kvroute's same-node data plane maps. The worker owns the memory: it creates it and frees it
(closes the memfd, unlinks the segment); kvroute only attaches.

``ShmPool`` makes a sealed memfd by default: sealed against shrinking (and growing), so nothing, the
worker included, can truncate it under a copy kvroute runs through its mapping. A plain ``/dev/shm``
segment (``sealed=False``) can be truncated, and a copy running at that moment faults kvroute's
process: it is the opt-in for workers that must share their pool by name.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import mmap
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# kvroute.transfer.shm's rules, repeated here so the client does not import the data plane (torch).
SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SHM_ROOT = Path("/dev/shm")
# The size is fixed and the seal set final: no one can shrink the pool or seal it against writes.
POOL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ShmPool:
    """Shared memory owned by this worker, viewed as a flat uint8 tensor: a sealed memfd by
    default, a named ``/dev/shm`` segment with ``sealed=False``.

    The memfd stays reachable for kvroute as long as this process keeps it open (its descriptor
    travels in ``descriptor()``). Created and mapped with ``os``/``mmap`` rather than
    ``multiprocessing.shared_memory``, whose finaliser raises when tensor views of the mapping
    outlive it and whose resource tracker unlinks segments behind the owner's back.
    """

    def __init__(self, name: str, nbytes: int, *, sealed: bool = True) -> None:
        import numpy as np
        import torch

        if not SHM_NAME.match(name):
            raise ValueError(f"shared-memory name {name!r} must match {SHM_NAME.pattern}")
        self.name = name
        self.nbytes = nbytes
        self.sealed = sealed
        self._path = SHM_ROOT / name
        if sealed:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:
            fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, POOL_SEALS)
            self._mapping: mmap.mmap | None = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            if not sealed:
                self._path.unlink(missing_ok=True)
            raise
        # kvroute reaches a memfd through this process's descriptor table, so it stays open.
        self._fd: int | None = fd if sealed else None
        if not sealed:
            os.close(fd)
        # numpy holds a buffer export while any view lives, so the mapping cannot vanish under one.
        self.tensor: torch.Tensor = torch.from_numpy(np.frombuffer(self._mapping, dtype=np.uint8))

    def descriptor(self, offset: int = 0) -> dict[str, Any]:
        if self._fd is not None:
            return {"backend": "memfd", "pid": os.getpid(), "fd": self._fd, "offset": offset}
        return {"backend": "shm", "name": self.name, "offset": offset}

    def close(self) -> None:
        """Frees the pool (closes the memfd, unlinks the segment); the mapping itself goes when
        the last tensor view is dropped."""
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        else:
            self._path.unlink(missing_ok=True)
        del self.tensor
        # Views of the pool may still be alive; the mapping is then released with the last one.
        with contextlib.suppress(BufferError):
            mapping.close()

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cuda_ipc_descriptor(tensor: torch.Tensor) -> dict[str, Any]:
    """The ``cuda_ipc`` memory descriptor of a CUDA tensor's allocation (slot 0 at its first byte)."""
    import torch

    if not torch.cuda.is_available() or not tensor.is_cuda:
        raise ValueError("cuda_ipc descriptors need a CUDA tensor on a host with CUDA")
    device, handle, storage_bytes, storage_offset, *_ = tensor.untyped_storage()._share_cuda_()
    # The handle names the caching allocator's whole block; the offset locates this tensor in it.
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return {
        "backend": "cuda_ipc",
        "handle": base64.b64encode(handle).decode(),
        "device": int(device),
        "offset": offset,
        "size": storage_offset + storage_bytes,
    }
