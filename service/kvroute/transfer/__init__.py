"""kvroute.transfer: the same-node data plane.

Reading path: memory (pool -> flat byte tensor; backends in memfd, shm (both through mapped),
cuda_ipc; opened: the pools a process holds, shared by jobs and closed when done) -> plan (the
typed ``geometry.Plan`` made executable) and exactly_once (its destination checks) -> program
(fragments folded into strided runs) -> jobs (what is submitted, its states) -> slots (state slots and prompt length a
leg needs) -> passes (a job's blocks or token range, a window's part of it or the state slot pair,
split into block-pair passes and cut pieces) -> engine (bounds checks and the copy strategies) ->
workers (threads, CUDA streams, the bounded queue, drain) -> metrics.

Typical use (names are imported on first use, so ``kvroute.transfer.errors`` needs no torch)::

    memories = PoolMemoryCache()                      # one per app; close() after drain
    pool = WorkerPool(workers=2, queue_size=64, registry=registry)
    await pool.start()
    plan = CopyPlan.from_plan(Plan.from_json(plan_doc))  # a served document read once
    leg = TransferLeg(plan, src_pools, dst_pools)     # pools via open_pool
    handle = await pool.submit(TransferJob([leg], src_blocks, dst_blocks))  # 202 with handle.job_id
    status = await handle                             # or pool.status(job_id) / pool.cancel(job_id)
    report = await pool.drain(10.0)
"""

from __future__ import annotations

import importlib

# Names -> the module that defines them. Imported on first use (PEP 562): the data plane needs
# torch, while its errors (``kvroute.transfer.errors``) must import where torch is absent, in the
# REST layer's one error table.
_EXPORTS: dict[str, str] = {
    "CopyEngine": "kvroute.transfer.engine",
    "CopyPlan": "kvroute.transfer.plan",
    "CopyProgram": "kvroute.transfer.program",
    "CopyResult": "kvroute.transfer.jobs",
    "CudaIpcBackend": "kvroute.transfer.cuda_ipc",
    "DrainReport": "kvroute.transfer.workers",
    "JobHandle": "kvroute.transfer.workers",
    "JobState": "kvroute.transfer.jobs",
    "JobStatus": "kvroute.transfer.jobs",
    "LocalBackend": "kvroute.transfer.memory",
    "MemoryBackend": "kvroute.transfer.memory",
    "PeerCopy": "kvroute.transfer.plan",
    "PoolDraining": "kvroute.transfer.errors",
    "PoolMemory": "kvroute.transfer.memory",
    "PoolMemoryCache": "kvroute.transfer.opened",
    "PoolOwner": "kvroute.transfer.opened",
    "PoolsExhausted": "kvroute.transfer.errors",
    "MemfdBackend": "kvroute.transfer.memfd",
    "PoolMemoryError": "kvroute.transfer.errors",
    "QueueFull": "kvroute.transfer.errors",
    "ShmBackend": "kvroute.transfer.shm",
    "Strategy": "kvroute.transfer.engine",
    "StridedRun": "kvroute.transfer.program",
    "TransferError": "kvroute.transfer.errors",
    "TransferJob": "kvroute.transfer.jobs",
    "TransferLeg": "kvroute.transfer.jobs",
    "TransferMetrics": "kvroute.transfer.metrics",
    "TransferValidationError": "kvroute.transfer.errors",
    "UnknownJob": "kvroute.transfer.errors",
    "ViewCopy": "kvroute.transfer.plan",
    "WorkerPool": "kvroute.transfer.workers",
    "compile_fragments": "kvroute.transfer.program",
    "default_backends": "kvroute.transfer.backends",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
