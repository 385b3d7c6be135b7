"""The memory backends a kvroute server opens pools with, in the order it tries them.

Kept apart from ``memory`` (the interface every backend implements) so that the interface imports
no backend and each backend imports only the interface.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.transfer.cuda_ipc import CudaIpcBackend
from kvroute.transfer.memfd import MemfdBackend
from kvroute.transfer.memory import MemoryBackend
from kvroute.transfer.shm import DEFAULT_NAME_PREFIX, ShmBackend


def default_backends(
    *, shm_name_prefix: str | None = None, shm_owners: Sequence[int] | None = None
) -> list[MemoryBackend]:
    """The backends a kvroute server opens: sealed memfds, shared memory and CUDA IPC."""
    prefix = DEFAULT_NAME_PREFIX if shm_name_prefix is None else shm_name_prefix
    return [
        MemfdBackend(name_prefix=prefix, owners=shm_owners),
        ShmBackend(name_prefix=prefix, owners=shm_owners),
        CudaIpcBackend(),
    ]
