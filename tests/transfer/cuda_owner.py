"""A worker process that exports a CUDA pool through an IPC handle, as a GPU rank registers it."""

from __future__ import annotations

import base64
from multiprocessing.queues import Queue

import torch

from tests.transfer.shm_owner import seeded_bytes


def serve(size: int, seed: int, replies: Queue, done: Queue) -> None:
    pool = torch.from_numpy(seeded_bytes(seed, size)).to("cuda:0")
    torch.cuda.synchronize()
    device, handle, storage_bytes, offset, *_ = pool.untyped_storage()._share_cuda_()
    replies.put(
        {
            "backend": "cuda_ipc",
            "handle": base64.b64encode(handle).decode(),
            "device": device,
            "offset": offset,
            "size": offset + storage_bytes,
        }
    )
    done.get(timeout=60)  # keep the allocation alive until kvroute is done with it
