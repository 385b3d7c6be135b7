"""kvroute.transfer: the same-node data plane.

Reading path: memory (pool -> flat byte tensor; backends in shm, cuda_ipc) -> plan (a plan
document made executable, checked for exactly-once) -> program (fragments folded into strided
runs) -> jobs (what is submitted, its states) -> slots (which block pairs or state slots each view
copies) -> engine (bounds checks and the copy strategies) -> workers (threads, CUDA streams, the
bounded queue, drain) -> metrics.

Typical use by the HTTP layer::

    memories = PoolMemoryCache()                      # one per app; close() after drain
    pool = WorkerPool(workers=2, queue_size=64, registry=registry)
    await pool.start()
    leg = TransferLeg(CopyPlan.from_json(plan_doc), src_pools, dst_pools)   # pools via open_pool
    handle = await pool.submit(TransferJob([leg], src_blocks, dst_blocks))  # 202 with handle.job_id
    status = await handle                             # or pool.status(job_id) / pool.cancel(job_id)
    report = await pool.drain(10.0)
"""

from kvroute.transfer.cuda_ipc import CudaIpcBackend
from kvroute.transfer.engine import CopyEngine, Strategy
from kvroute.transfer.errors import (
    PoolDraining,
    PoolMemoryError,
    QueueFull,
    TransferError,
    TransferValidationError,
    UnknownJob,
)
from kvroute.transfer.jobs import CopyResult, JobState, JobStatus, TransferJob, TransferLeg
from kvroute.transfer.memory import (
    LocalBackend,
    MemoryBackend,
    PoolMemory,
    PoolMemoryCache,
    default_backends,
)
from kvroute.transfer.metrics import TransferMetrics
from kvroute.transfer.plan import CopyPlan, PeerCopy, ViewCopy, WindowCopy
from kvroute.transfer.program import CopyProgram, StridedRun, compile_fragments
from kvroute.transfer.shm import ShmBackend
from kvroute.transfer.workers import DrainReport, JobHandle, WorkerPool

__all__ = [
    "CopyEngine",
    "CopyPlan",
    "CopyProgram",
    "CopyResult",
    "CudaIpcBackend",
    "DrainReport",
    "JobHandle",
    "JobState",
    "JobStatus",
    "LocalBackend",
    "MemoryBackend",
    "PeerCopy",
    "PoolDraining",
    "PoolMemory",
    "PoolMemoryCache",
    "PoolMemoryError",
    "QueueFull",
    "ShmBackend",
    "Strategy",
    "StridedRun",
    "TransferError",
    "TransferJob",
    "TransferLeg",
    "TransferMetrics",
    "TransferValidationError",
    "UnknownJob",
    "ViewCopy",
    "WindowCopy",
    "WorkerPool",
    "compile_fragments",
    "default_backends",
]
