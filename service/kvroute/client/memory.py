"""Pool memory a kvroute process can open: POSIX shared memory and CUDA IPC descriptors.

The descriptors follow ``kvroute.transfer``'s conventions exactly (``shm``: a segment name under
/dev/shm and the offset of slot 0; ``cuda_ipc``: the allocation's IPC handle, device, offset and
size), so what a worker registers is what kvroute's same-node data plane maps. The worker owns the
memory: it creates the segment and unlinks it; kvroute only attaches.
"""

from __future__ import annotations

import base64
import contextlib
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


class ShmPool:
    """A POSIX shared-memory segment owned by this worker, viewed as a flat uint8 tensor.

    Created and mapped with ``os``/``mmap`` rather than ``multiprocessing.shared_memory``, whose
    finaliser raises when tensor views of the mapping outlive it and whose resource tracker
    unlinks segments behind the owner's back.
    """

    def __init__(self, name: str, nbytes: int) -> None:
        import numpy as np
        import torch

        if not SHM_NAME.match(name):
            raise ValueError(f"shared-memory name {name!r} must match {SHM_NAME.pattern}")
        self.name = name
        self.nbytes = nbytes
        self._path = SHM_ROOT / name
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mapping: mmap.mmap | None = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        # numpy holds a buffer export while any view lives, so the mapping cannot vanish under one.
        self.tensor: torch.Tensor = torch.from_numpy(np.frombuffer(self._mapping, dtype=np.uint8))

    def descriptor(self, offset: int = 0) -> dict[str, Any]:
        return {"backend": "shm", "name": self.name, "offset": offset}

    def close(self) -> None:
        """Unlinks the segment; the mapping itself goes when the last tensor view is dropped."""
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
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
