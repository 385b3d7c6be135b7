"""A rank's pools as digests and the canary reach them: in place on the host, staged off a GPU.

The readers of ``client.kv_rows`` and ``client.kv_state`` take a rank's pools as flat host arrays
(slot ``s`` at ``s x slot_stride``). A CPU engine's cache is host memory, read in place
(``HostPools``). A GPU engine's cache is device memory, which numpy cannot address, and mirroring
the whole cache on the host would double its footprint for a sampled request's few blocks; so
``DevicePools`` copies just the slots one use reads (a sampled request's blocks, the null block)
into host arrays of their own, slot ``slots[i]`` at position ``i``, and copies back what the
writers changed there (the producer's canary image, a round's zeroing). Each use is one gather per
pool and one copy to the host, whatever the layout.

A stage is read after the device has finished the work queued on it (``torch.cuda.synchronize``
on the device, from the caller's thread: the engine's step does not wait), so a producer digests
its blocks as its forward pass wrote them and a consumer what NIXL's completed reads left; a
write-back returns once the bytes are on the device, before the canary's pull is posted.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvroute.client.nixl_descs import PoolAddress

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Staged:
    """Pools as host arrays and where each slot is in them (``at``; None: in place)."""

    pools: Mapping[int, np.ndarray]
    at: Mapping[int, int] | None = None

    def blocks(self, blocks: Sequence[int]) -> list[int]:
        """A block list in the stage's positions."""
        return list(blocks) if self.at is None else [self.at[block] for block in blocks]


class PoolAccess(Protocol):
    """How digests and the canary read and write a rank's pools."""

    def stage(self, slots: Iterable[int]) -> Staged:
        """Host arrays holding at least ``slots`` of every pool."""

    def write_back(self, staged: Staged) -> None:
        """Makes what was written into ``staged`` the pools' own bytes."""

    def zero(self, slots: Iterable[int]) -> None:
        """Zeroes ``slots`` of every pool, whole."""


def pool_access(addresses: Mapping[int, PoolAddress], mem_type: str) -> PoolAccess:
    """Host memory (NIXL ``DRAM``) in place, device memory staged; raises where the device cannot
    be reached (no CUDA in this torch)."""
    return HostPools(addresses) if mem_type == "DRAM" else DevicePools.at(addresses)


class HostPools:
    """Host memory (a CPU engine's cache), read and written in place."""

    def __init__(self, addresses: Mapping[int, PoolAddress]) -> None:
        self.addresses = dict(addresses)
        self.pools = {
            pool: np.ctypeslib.as_array(
                (ctypes.c_uint8 * (at.slot_stride * at.num_slots)).from_address(at.base)
            )
            for pool, at in addresses.items()
        }

    def stage(self, slots: Iterable[int]) -> Staged:
        return Staged(self.pools)

    def write_back(self, staged: Staged) -> None:
        """Nothing to copy: the stage is the pools."""

    def zero(self, slots: Iterable[int]) -> None:
        wanted = list(slots)
        for pool, at in self.addresses.items():
            self.pools[pool].reshape(at.num_slots, at.slot_stride)[wanted] = 0


class DevicePools:
    """Pools as ``[slots, slot_stride]`` uint8 tensors (device memory: ``at``), staged slot by
    slot on the host."""

    def __init__(self, tensors: Mapping[int, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    @classmethod
    def at(cls, addresses: Mapping[int, PoolAddress]) -> DevicePools:
        """The pools of a CUDA device's registered allocations, viewed through their addresses
        (a pool may span several of vLLM's layer tensors, so no one tensor is the pool)."""
        import torch

        return cls(
            {
                pool: torch.as_tensor(
                    _DeviceSpan(at.base, at.slot_stride * at.num_slots),
                    device=torch.device("cuda", at.device),
                ).view(at.num_slots, at.slot_stride)
                for pool, at in addresses.items()
            }
        )

    def stage(self, slots: Iterable[int]) -> Staged:
        import torch

        wanted = sorted(set(slots))
        self._settled()
        pools = {}
        for pool, tensor in self.tensors.items():
            index = torch.tensor(wanted, dtype=torch.int64, device=tensor.device)
            pools[pool] = tensor.index_select(0, index).cpu().numpy().reshape(-1)
        return Staged(pools, {slot: i for i, slot in enumerate(wanted)})

    def write_back(self, staged: Staged) -> None:
        import torch

        assert staged.at is not None, "a stage of device pools knows its slots"
        slots = sorted(staged.at, key=staged.at.__getitem__)
        for pool, tensor in self.tensors.items():
            index = torch.tensor(slots, dtype=torch.int64, device=tensor.device)
            rows = torch.from_numpy(staged.pools[pool].reshape(len(slots), -1))
            tensor.index_copy_(0, index, rows.to(tensor.device))
        self._settled()

    def zero(self, slots: Iterable[int]) -> None:
        import torch

        wanted = list(slots)
        for tensor in self.tensors.values():
            tensor.index_fill_(0, torch.tensor(wanted, dtype=torch.int64, device=tensor.device), 0)
        self._settled()

    def _settled(self) -> None:
        import torch

        for device in {tensor.device for tensor in self.tensors.values()}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


class _DeviceSpan:
    """Device bytes as ``torch.as_tensor`` takes them (CUDA array interface, version 3)."""

    def __init__(self, base: int, size: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (size,),
            "typestr": "|u1",
            "strides": None,  # C-contiguous
            "data": (base, False),
            "version": 3,
        }
