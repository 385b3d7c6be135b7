"""The copy engine: executes a transfer job's fragments with a handful of tensor operations.

For every sending rank and view of every leg the engine splits the job into passes (paired block
lists for one fragment set: the job's block pairs, one block pair of a period in every period of a
token range, or the few copies of the blocks a range cuts, a windowed view's from its window on, or
the request's state slot pair for recurrent state; see ``passes`` and ``slots``), compiles each pass's
fragments once (cached by plan fingerprint, see ``program``), checks them and the job's block ids
against the concrete pools, then copies each pass with one of three strategies over a strided view
of each pool whose first dimension is the slot:

- ``blockwise``: per run of consecutive block pairs, one strided ``copy_`` of a whole slot region.
  No index tensors and no staging copy, so it runs near memcpy speed on the CPU (the default there).
- ``gather``: per strided run, ``index_select`` the source slots and ``index_copy_`` them into the
  destination slots: two kernels per run whatever the block count (the default on CUDA).
- ``indexed``: flat element indices for all views of a pool pair, expanded once per plan and
  widened per job by the block bases: one gather and one scatter in total, for irregular plans
  that compile to many runs.

``bench/transfer_bench.py`` measures all three strategies against a raw contiguous copy and a
naive per-fragment loop; the defaults follow its numbers.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from functools import partial, reduce
from itertools import groupby
from typing import Generic, TypeVar

import numpy as np
import torch
from cachetools import LRUCache

from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.jobs import CopyResult, TransferJob
from kvroute.transfer.memory import PoolMemory
from kvroute.transfer.passes import view_work
from kvroute.transfer.plan import ViewCopy
from kvroute.transfer.program import CopyProgram, StridedRun, compile_fragments
from kvroute.transfer.slots import check_leg, state_slots

GATHER_MAX_RUNS = 8  # above this many runs per pool pair, one indexed gather beats per-run kernels
INDEXED_MAX_ELEMENTS = 1 << 24  # 128 MiB of int64 indices per side: beyond that, gather per run
_DTYPE_BY_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

K = TypeVar("K")
V = TypeVar("V")


class Strategy(StrEnum):
    BLOCKWISE = "blockwise"
    GATHER = "gather"
    INDEXED = "indexed"


class _LruCache(Generic[K, V]):
    """An LRU map the worker threads share; values are computed outside the lock (a race computes
    one twice, harmlessly: compiled programs of one key are equal)."""

    def __init__(self, size: int) -> None:
        self._entries: LRUCache[K, V] = LRUCache(size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value

    def get_or_compute(self, key: K, compute: Callable[[], V]) -> V:
        with self._lock:
            if key in self._entries:
                return self._entries[key]
        value = compute()
        self.put(key, value)
        return value


@dataclass(frozen=True, slots=True)
class _Pass:
    """A compiled fragment set and the block pairs it is applied to."""

    # plan fingerprint, sender rank, view index (, period block pair); None: compiled for one job
    cache_key: tuple[object, ...] | None
    program: CopyProgram
    src_blocks: np.ndarray
    dst_blocks: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.program.nbytes * len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class _ViewTask:
    """One view of one sending rank, bound to its opened pools."""

    group: tuple[int, int, int, int]  # leg, sender rank, src pool, dst pool
    passes: tuple[_Pass, ...]
    src: PoolMemory
    dst: PoolMemory

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.passes)

    @property
    def fragments(self) -> int:
        return sum(p.program.fragments * len(p.src_blocks) for p in self.passes)


class CopyEngine:
    """Validates and executes transfer jobs; caches compiled plans. Safe to share between threads."""

    def __init__(self, *, cache_size: int = 1024, strategy: Strategy | None = None) -> None:
        self._programs: _LruCache[tuple[object, ...], CopyProgram] = _LruCache(cache_size)
        self._elements: _LruCache[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = (
            _LruCache(64)
        )
        # validate() on the event loop and copy() on a worker split the same job: split it once
        self._jobs: _LruCache[str, tuple[TransferJob, list[_ViewTask]]] = _LruCache(64)
        self._strategy = strategy

    def validate(self, job: TransferJob) -> CopyResult:
        """Raise ``TransferValidationError`` if the job can not run as given; copies nothing.

        Returns what ``copy`` will report (``totals``).
        """
        return self.totals(job)

    def copy(self, job: TransferJob, *, strategy: Strategy | None = None) -> CopyResult:
        """Copy every fragment of every block pair; returns bytes and fragments x blocks."""
        tasks = self._tasks(job)
        for _, grouped in groupby(tasks, key=lambda task: task.group):
            group = list(grouped)
            chosen = strategy or self._strategy or self._choose(group)
            if chosen is Strategy.INDEXED:
                _copy_indexed(group, self._elements)
            else:
                copy_pass = _copy_blockwise if chosen is Strategy.BLOCKWISE else _copy_gathered
                for task in group:
                    for part in task.passes:
                        copy_pass(part, task)
        return self.totals(job, tasks)

    def totals(self, job: TransferJob, tasks: list[_ViewTask] | None = None) -> CopyResult:
        """What ``copy`` moves for ``job``: bytes, and fragments counted once per block they copy."""
        tasks = self._tasks(job) if tasks is None else tasks
        return CopyResult(
            bytes=sum(task.nbytes for task in tasks),
            fragments=sum(task.fragments for task in tasks),
        )

    def devices(self, job: TransferJob) -> set[torch.device]:
        """Devices the job touches: the worker makes its own stream current on each CUDA one."""
        return {memory.device for task in self._tasks(job) for memory in (task.src, task.dst)}

    @staticmethod
    def _choose(group: list[_ViewTask]) -> Strategy:
        first = group[0]
        if first.src.device.type == "cpu" or first.dst.device.type == "cpu":
            return Strategy.BLOCKWISE
        passes = [part for task in group for part in task.passes]
        if sum(len(part.program.runs) for part in passes) <= GATHER_MAX_RUNS:
            return Strategy.GATHER
        elements = sum(part.nbytes for part in passes) // _width(passes, first.src, first.dst)
        return Strategy.INDEXED if elements <= INDEXED_MAX_ELEMENTS else Strategy.GATHER

    def _tasks(self, job: TransferJob) -> list[_ViewTask]:
        cached = self._jobs.get(job.job_id)
        if cached is not None and cached[0] is job:
            return cached[1]
        _check_unique(job.dst_blocks)
        for leg_index, leg in enumerate(job.legs):
            check_leg(job, leg, leg_index)
        tasks = [
            self._task(job, leg_index, peer.rank, index, view)
            for leg_index, leg in enumerate(job.legs)
            for peer in leg.plan.senders
            for index, view in enumerate(peer.copies)
        ]
        tasks.sort(key=lambda task: task.group)
        self._jobs.put(job.job_id, (job, tasks))
        return tasks

    def _task(
        self, job: TransferJob, leg_index: int, rank: int, index: int, view: ViewCopy
    ) -> _ViewTask:
        leg = job.legs[leg_index]
        where = f"sender rank {rank}"
        src = leg.src_pools.get((rank, view.src_pool))
        dst = leg.dst_pools.get(view.dst_pool)
        if src is None or dst is None:
            missing = (
                f"{where} pool {view.src_pool}" if src is None else f"receiver pool {view.dst_pool}"
            )
            raise TransferValidationError(f"legs[{leg_index}]", f"no opened memory for {missing}")
        src_end, dst_end = view.extent
        _check_extent(src_end, src, f"{where} pool {view.src_pool}")
        _check_extent(dst_end, dst, f"receiver pool {view.dst_pool}")
        src_ids, dst_ids = state_slots(job) if view.state else (job.src_blocks, job.dst_blocks)
        names = ("src_state_slot", "dst_state_slot") if view.state else ("src_blocks", "dst_blocks")
        _check_blocks(src_ids, src, names[0], f"{where} pool {view.src_pool}")
        _check_blocks(dst_ids, dst, names[1], f"receiver pool {view.dst_pool}")
        key = (leg.plan.fingerprint, rank, index)
        passes = tuple(
            _Pass(
                part.key, self._program(part.key, part.fragments), part.src_blocks, part.dst_blocks
            )
            for part in view_work(view, key, job, f"legs[{leg_index}].{where}.views[{index}]")
        )
        group = (leg_index, rank, view.src_pool, view.dst_pool)
        return _ViewTask(group, passes, src, dst)

    def _program(self, key: tuple[object, ...] | None, fragments: np.ndarray) -> CopyProgram:
        if key is None:
            return compile_fragments(fragments)
        return self._programs.get_or_compute(key, partial(compile_fragments, fragments))


def _check_unique(dst_blocks: np.ndarray) -> None:
    values, counts = np.unique(dst_blocks, return_counts=True)
    if (counts > 1).any():
        block = int(values[np.argmax(counts > 1)])
        raise TransferValidationError(
            "dst_blocks", f"block id {block} appears more than once; each is written exactly once"
        )


def _check_extent(end: int, memory: PoolMemory, where: str) -> None:
    if end > memory.pool.slot_bytes:
        raise TransferValidationError(
            "plan.fragments",
            f"a fragment ends at byte {end} of a slot, beyond slot_bytes "
            f"{memory.pool.slot_bytes} of {where}",
        )


def _check_blocks(blocks: np.ndarray, memory: PoolMemory, name: str, where: str) -> None:
    bad = np.flatnonzero((blocks < 0) | (blocks >= memory.pool.num_slots))
    if len(bad):
        index = int(bad[0])
        state = name.endswith("_state_slot")
        field, what = (name, "state slot") if state else (f"{name}[{index}]", "block id")
        raise TransferValidationError(
            field,
            f"{what} {int(blocks[index])} is outside {where} (num_slots {memory.pool.num_slots})",
        )


def _width(passes: list[_Pass], src: PoolMemory, dst: PoolMemory, *more: int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that every offset, stride and address divides."""
    values = [part.program.alignment for part in passes] + list(more)
    for memory in (src, dst):
        tensor = memory.tensor
        values += [memory.pool.slot_stride, tensor.data_ptr(), int(tensor.storage_offset())]
    common = reduce(math.gcd, values, 0)
    return next(width for width in (8, 4, 2, 1) if common % width == 0)


def _slot_view(memory: PoolMemory, width: int, run: StridedRun, side: str) -> torch.Tensor:
    """The run's bytes in every slot: a view of shape (num_slots, *run.shape) in ``width`` units."""
    flat = memory.tensor.view(_DTYPE_BY_WIDTH[width])
    offset, strides = (
        (run.src_offset, run.src_strides) if side == "src" else (run.dst_offset, run.dst_strides)
    )
    return flat.as_strided(
        (memory.pool.num_slots, *run.shape[:-1], run.shape[-1] // width),
        (memory.pool.slot_stride // width, *(stride // width for stride in strides[:-1]), 1),
        flat.storage_offset() + offset // width,
    )


def block_spans(src_blocks: np.ndarray, dst_blocks: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of block pairs consecutive on both sides: (src start, dst start, count)."""
    breaks = np.flatnonzero((np.diff(src_blocks) != 1) | (np.diff(dst_blocks) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(src_blocks)])))
    return zip(
        src_blocks[starts].tolist(), dst_blocks[starts].tolist(), counts.tolist(), strict=True
    )


def _copy_blockwise(part: _Pass, task: _ViewTask) -> None:
    width = _width([part], task.src, task.dst)
    spans = list(block_spans(part.src_blocks, part.dst_blocks))
    for run in part.program.runs:
        src = _slot_view(task.src, width, run, "src")
        dst = _slot_view(task.dst, width, run, "dst")
        for src_block, dst_block, count in spans:
            dst[dst_block : dst_block + count].copy_(src[src_block : src_block + count])


def _copy_gathered(part: _Pass, task: _ViewTask) -> None:
    width = _width([part], task.src, task.dst)
    src_index = torch.tensor(part.src_blocks, device=task.src.device)
    dst_index = torch.tensor(part.dst_blocks, device=task.dst.device)
    for run in part.program.runs:
        src = _slot_view(task.src, width, run, "src")
        dst = _slot_view(task.dst, width, run, "dst")
        dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))


def _copy_indexed(
    group: list[_ViewTask],
    cache: _LruCache[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    src, dst = group[0].src, group[0].dst
    passes = [part for task in group for part in task.passes]
    if not passes:
        return
    width = _width(passes, src, dst)
    src_parts, dst_parts = [], []
    for same_blocks in _by_block_lists(passes):
        # Passes over the same block lists (every view of a block-pair job) share one expansion:
        # the index arrays are as large as the data, so each extra pass over them costs a copy.
        src_rel, dst_rel = _relative_elements(same_blocks, width, src, dst, cache)
        first = same_blocks[0]
        src_base = torch.tensor(first.src_blocks, device=src.device) * (
            src.pool.slot_stride // width
        )
        dst_base = torch.tensor(first.dst_blocks, device=dst.device) * (
            dst.pool.slot_stride // width
        )
        src_parts.append((src_base[:, None] + src_rel).reshape(-1))
        dst_parts.append((dst_base[:, None] + dst_rel).reshape(-1))
    src_index = src_parts[0] if len(src_parts) == 1 else torch.cat(src_parts)
    dst_index = dst_parts[0] if len(dst_parts) == 1 else torch.cat(dst_parts)
    src_flat = src.tensor.view(_DTYPE_BY_WIDTH[width])
    dst_flat = dst.tensor.view(_DTYPE_BY_WIDTH[width])
    dst_flat.index_copy_(0, dst_index, src_flat.index_select(0, src_index).to(dst.device))


def _by_block_lists(passes: list[_Pass]) -> list[list[_Pass]]:
    """The passes grouped by the block lists they apply to, in first-seen order."""
    groups: dict[tuple[bytes, bytes], list[_Pass]] = {}
    for part in passes:
        key = (part.src_blocks.tobytes(), part.dst_blocks.tobytes())
        groups.setdefault(key, []).append(part)
    return list(groups.values())


def _relative_elements(
    parts: list[_Pass],
    width: int,
    src: PoolMemory,
    dst: PoolMemory,
    cache: _LruCache[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-relative element indices of the passes' programs, back to back, expanded once per
    plan and width."""

    def expand() -> tuple[torch.Tensor, torch.Tensor]:
        offsets = [part.program.element_offsets(width) for part in parts]
        src_rel = torch.from_numpy(np.concatenate([pair[0] for pair in offsets])).to(src.device)
        dst_rel = torch.from_numpy(np.concatenate([pair[1] for pair in offsets])).to(dst.device)
        for tensor in (src_rel, dst_rel):
            if tensor.is_cuda:
                # other workers read the cached indices on their own streams: finish the upload first
                torch.cuda.current_stream(tensor.device).synchronize()
        return src_rel, dst_rel

    keys = [part.cache_key for part in parts]
    if any(key is None for key in keys):
        src_rel, dst_rel = expand()
    else:
        src_rel, dst_rel = cache.get_or_compute((*keys, width, src.device, dst.device), expand)
    for tensor in (src_rel, dst_rel):
        if tensor.is_cuda:
            # the cache may evict and free these while this stream still reads them
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return src_rel, dst_rel
