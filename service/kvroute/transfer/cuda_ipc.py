"""CUDA IPC pools: device memory exported by a worker process, opened on the right GPU.

The descriptor carries the 64-byte ``cudaIpcMemHandle_t`` (base64) of the worker's allocation, the
device ordinal, the byte offset of slot 0 inside that allocation (torch's caching allocator hands out
sub-ranges of larger blocks, and the handle always names the block) and, optionally, the size of the
allocation so the extent can be checked before any copy. The handle is opened with CuPy's runtime
bindings and wrapped as a torch tensor through ``__cuda_array_interface__``, with no copy.
"""

from __future__ import annotations

import base64
import binascii
import importlib
from typing import Any

import torch

from kvroute.geometry import Pool
from kvroute.transfer.errors import PoolMemoryError
from kvroute.transfer.memory import Descriptor, PoolMemory, check_extent, descriptor_offset

IPC_HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess: the only flag the runtime accepts


class _DeviceBytes:
    """The minimal ``__cuda_array_interface__`` torch needs to wrap raw device bytes."""

    def __init__(self, pointer: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


class CudaIpcBackend:
    name = "cuda_ipc"

    def open(self, descriptor: Descriptor, pool: Pool) -> PoolMemory:
        if not torch.cuda.is_available():
            raise PoolMemoryError(pool.pool_id, self.name, "CUDA is not available to this kvroute")
        device = self._device(descriptor, pool)
        handle = self._handle(descriptor, pool)
        offset = descriptor_offset(descriptor, pool, self.name)
        size = descriptor.get("size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int):
                raise PoolMemoryError(
                    pool.pool_id, self.name, f"size must be an integer, got {size!r}"
                )
            check_extent(size, offset, pool, self.name)
        runtime = self._runtime(pool)
        with runtime.cuda.Device(device), torch.cuda.device(device):
            try:
                base = runtime.cuda.runtime.ipcOpenMemHandle(handle, LAZY_ENABLE_PEER_ACCESS)
            except runtime.cuda.runtime.CUDARuntimeError as error:
                raise PoolMemoryError(
                    pool.pool_id, self.name, f"cannot open handle: {error}"
                ) from error
            view = _DeviceBytes(base + offset, pool.size_bytes)
            tensor = torch.as_tensor(view, device=torch.device("cuda", device))

        def release() -> None:
            with runtime.cuda.Device(device):
                runtime.cuda.runtime.ipcCloseMemHandle(base)

        return PoolMemory(pool, self.name, tensor, release)

    def _device(self, descriptor: Descriptor, pool: Pool) -> int:
        device = descriptor.get("device", 0)
        count = torch.cuda.device_count()
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"device {device!r} is not one of this host's {count} GPUs"
            )
        return device

    def _handle(self, descriptor: Descriptor, pool: Pool) -> bytes:
        encoded = descriptor.get("handle")
        try:
            handle = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else b""
        except (binascii.Error, ValueError):
            handle = b""
        if len(handle) != IPC_HANDLE_BYTES:
            raise PoolMemoryError(
                pool.pool_id, self.name, f"handle must be {IPC_HANDLE_BYTES} bytes, base64-encoded"
            )
        return handle

    def _runtime(self, pool: Pool) -> Any:
        try:
            return importlib.import_module("cupy")
        except ImportError as error:
            raise PoolMemoryError(
                pool.pool_id, self.name, "opening CUDA IPC handles needs CuPy (cupy-cuda12x)"
            ) from error
