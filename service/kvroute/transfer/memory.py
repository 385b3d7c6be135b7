"""Pool memory: one small interface from a registered pool to a flat byte tensor.

A registration describes where a pool's bytes live (``memory``: shared memory, a CUDA IPC handle, or a
tensor living in this process). The copy engine only ever sees ``PoolMemory``: a flat ``uint8`` tensor
of exactly ``num_slots * slot_stride`` bytes, so slot ``s`` starts at byte ``s * slot_stride`` whatever
the backend. Opening is the only place a backend's quirks appear, and every failure surfaces as one
``PoolMemoryError`` naming the pool, the backend and the reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError

log = logging.getLogger(__name__)

Descriptor = Mapping[str, Any]


class PoolMemory:
    """An opened pool: ``tensor`` is its flat uint8 bytes; ``close()`` releases the mapping.

    ``verify`` (from the backend) raises ``PoolMemoryError`` once the memory behind the tensor can
    no longer be used safely: a shared-memory segment that shrank, changed owner or was replaced.
    """

    __slots__ = ("_release", "_tensor", "_verify", "backend", "descriptors", "pool")

    def __init__(
        self,
        pool: Pool,
        backend: str,
        tensor: torch.Tensor,
        release: Callable[[], None] | None = None,
        verify: Callable[[], None] | None = None,
        *,
        descriptors: int = 0,
    ) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise PoolMemoryError(
                pool.pool_id, backend, "memory is not a flat contiguous uint8 tensor"
            )
        if tensor.numel() != pool.size_bytes:
            raise PoolMemoryError(
                pool.pool_id,
                backend,
                f"mapped {tensor.numel()} bytes, expected num_slots * slot_stride = {pool.size_bytes}",
            )
        self.pool = pool
        self.backend = backend
        self._tensor: torch.Tensor | None = tensor
        self._release = release
        self._verify = verify
        self.descriptors = descriptors  # file descriptors the open memory holds

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise PoolMemoryError(self.pool.pool_id, self.backend, "memory was closed")
        return self._tensor

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def verify(self) -> None:
        """Raises ``PoolMemoryError`` unless the memory is still safe to copy through right now."""
        if self._tensor is None:
            raise PoolMemoryError(self.pool.pool_id, self.backend, "memory was closed")
        if self._verify is not None:
            self._verify()

    def close(self) -> None:
        """Drop the tensor, then release the mapping (idempotent)."""
        if self._tensor is None:
            return
        self._tensor = None
        release, self._release = self._release, None
        if release is not None:
            release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else str(self.device)
        return f"PoolMemory(pool={self.pool.pool_id}, backend={self.backend}, {state})"


class MemoryBackend(Protocol):
    """Maps one kind of ``memory`` descriptor to a ``PoolMemory``."""

    name: str

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory: ...


def descriptor_offset(descriptor: Descriptor, pool: Pool, backend: str) -> int:
    """The descriptor's byte offset of slot 0 inside the mapping (0 when absent)."""
    offset = descriptor.get("offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise PoolMemoryError(
            pool.pool_id, backend, f"offset must be an integer >= 0, got {offset!r}"
        )
    return offset


def check_extent(size: int, offset: int, pool: Pool, backend: str) -> None:
    """Refuse a mapping too small for ``offset + num_slots * slot_stride`` bytes."""
    needed = offset + pool.size_bytes
    if size < needed:
        raise PoolMemoryError(
            pool.pool_id,
            backend,
            f"mapping is {size} bytes but offset + num_slots * slot_stride needs {needed}",
        )


class LocalBackend:
    """Tensors registered in this process under a name: tests, demos, a co-located engine."""

    name = "local"

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def register(self, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"local pool memory {name!r} must be a contiguous tensor")
        with self._lock:
            self._tensors[name] = tensor

    def unregister(self, name: str) -> None:
        with self._lock:
            self._tensors.pop(name, None)

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        name = descriptor.get("name")
        with self._lock:
            tensor = self._tensors.get(name) if isinstance(name, str) else None
        if tensor is None:
            raise PoolMemoryError(pool.pool_id, self.name, f"no local tensor named {name!r}")
        flat = tensor.reshape(-1).view(torch.uint8)
        offset = descriptor_offset(descriptor, pool, self.name)
        check_extent(flat.numel(), offset, pool, self.name)
        return PoolMemory(pool, self.name, flat[offset : offset + pool.size_bytes])
