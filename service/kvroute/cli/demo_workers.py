"""The ``kvroute demo`` deployment: geometry, ground truth and the simulated worker processes.

Context and generation ranks run as separate processes that own POSIX shared-memory pools, as real
workers own their KV cache; kvroute only maps them. Context pools are filled with a ground-truth
pattern computed from (block, layer, K/V, global head, token, element), so a generation rank can
check every byte it received for the heads it holds without trusting the plan that moved them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from multiprocessing.queues import Queue
from typing import Any

import torch

from kvroute.client import KvrouteClient
from kvroute.client.memory import ShmPool
from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, rank_document
from kvroute.geometry import Kind, Owner

DEPLOYMENT = "demo"
COMMAND_WAIT_S = 300.0


@dataclass(frozen=True, slots=True)
class Model:
    """A model's KV geometry and the two instances' layouts."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    draft_kv_heads: int
    num_slots: int
    context_tp: int = 4
    generation_tp: int = 2
    dtype: str = "bfloat16"

    def layouts(self, tp_size: int) -> tuple[KvLayout, KvLayout]:
        target = KvLayout(
            Kind.HND,
            self.layers,
            heads_of(self.kv_heads, tp_size, 0)[1],
            self.tokens_per_block,
            self.head_dim,
            self.dtype,
            total_kv_heads=self.kv_heads,
        )
        draft = KvLayout(
            Kind.HND,
            1,
            heads_of(self.draft_kv_heads, tp_size, 0)[1],
            self.tokens_per_block,
            self.head_dim,
            self.dtype,
            owner=Owner.DRAFT,
            total_kv_heads=self.draft_kv_heads,
        )
        return target, draft


# A Llama-3-8B-like target (32 layers, 8 KV heads, head_dim 128) with a one-layer Eagle draft
# holding 2 KV heads; 48 slots keep all six pools under 0.5 GiB.
FULL = Model(
    layers=32, kv_heads=8, head_dim=128, tokens_per_block=32, draft_kv_heads=2, num_slots=48
)
SMALL = Model(layers=4, kv_heads=8, head_dim=16, tokens_per_block=4, draft_kv_heads=2, num_slots=12)


def heads_of(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first global head, heads held) of a rank, DESIGN.md rule 1."""
    if tp_size <= total:
        per_rank = total // tp_size
        return tp_rank * per_rank, per_rank
    return tp_rank * total // tp_size, 1


def truth(layout: KvLayout, block: int, first_head: int) -> torch.Tensor:
    """The ground-truth int16 words of one block of ``layout`` holding heads from ``first_head``."""
    layer, kv, head, token, element = (
        torch.arange(n, dtype=torch.int64).view(*([1] * i), n, *([1] * (4 - i)))
        for i, n in enumerate(layout.block_shape)
    )
    owner_salt = 0 if layout.owner is Owner.TARGET else 50_021
    words = (
        block * 1_000_003
        + (layout.first_layer + layer) * 10_007
        + kv * 101
        + (first_head + head) * 7_919
        + token * 131
        + element
        + owner_salt
    ) % 65_521
    return (words - 32_760).to(torch.int16)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    token: str
    role: str
    instance: str
    tp_size: int
    tp_rank: int
    model: Model
    shm_name: str


def _pool(spec: WorkerSpec) -> tuple[ShmPool, SharedKvPool, list[KvLayout]]:
    layouts = list(spec.model.layouts(spec.tp_size))
    stride = SharedKvPool.carve(layouts, 1).slot_stride
    memory = ShmPool(spec.shm_name, stride * spec.model.num_slots)
    memory.tensor.zero_()
    return memory, SharedKvPool.carve(layouts, spec.model.num_slots, buffer=memory.tensor), layouts


def _first_heads(spec: WorkerSpec) -> list[int]:
    model = spec.model
    return [
        heads_of(total, spec.tp_size, spec.tp_rank)[0]
        for total in (model.kv_heads, model.draft_kv_heads)
    ]


def fill(spec: WorkerSpec, pool: SharedKvPool, layouts: list[KvLayout]) -> None:
    for tensor, layout, first in zip(pool.tensors, layouts, _first_heads(spec), strict=True):
        words = tensor.view(torch.int16)
        for block in range(spec.model.num_slots):
            words[block] = truth(layout, block, first)


def requests(model: Model, jobs: int) -> list[dict[str, Any]]:
    """Disjoint block batches, reversed order on the receiver: one transfer each."""
    per_job = model.num_slots // jobs
    batches = [list(range(job * per_job, (job + 1) * per_job)) for job in range(jobs)]
    return [
        {"src_blocks": src, "dst_blocks": [model.num_slots - 1 - block for block in src]}
        for src in batches
    ]


def incompatible_document(model: Model) -> dict[str, Any]:
    """A generation rank whose blocks hold half the tokens: kvroute must refuse it."""
    halved = [
        replace(layout, tokens_per_block=layout.tokens_per_block // 2)
        for layout in model.layouts(model.generation_tp)
    ]
    pool = replace(SharedKvPool.carve(halved, 1).describe(), num_slots=4)
    return rank_document(
        role="generation",
        target=halved[0],
        pools=[pool],
        num_draft_layers=1,
        parallel=Parallel(tp_size=model.generation_tp),
    )


def verify(
    spec: WorkerSpec, pool: SharedKvPool, layouts: list[KvLayout], jobs: list[dict[str, Any]]
) -> dict[str, int]:
    """Bytes checked and wrong, over received blocks (truth of the source block) and the rest (zero)."""
    checked = wrong = 0
    received = {
        dst: src
        for job in jobs
        for src, dst in zip(job["src_blocks"], job["dst_blocks"], strict=True)
    }
    for tensor, layout, first in zip(pool.tensors, layouts, _first_heads(spec), strict=True):
        words = tensor.view(torch.int16)
        for block in range(spec.model.num_slots):
            src = received.get(block)
            expected = (
                truth(layout, src, first) if src is not None else torch.zeros_like(words[block])
            )
            wrong += int((words[block] != expected).sum()) * 2
            checked += words[block].numel() * 2
    return {"checked": checked, "wrong": wrong}


def serve(spec: WorkerSpec, commands: Queue, replies: Queue) -> None:
    """A worker process: own and fill the pool, register and keep the lease, answer commands."""
    memory, pool, layouts = _pool(spec)
    try:
        if spec.role == "context":
            fill(spec, pool, layouts)
        document = rank_document(
            role=spec.role,
            target=layouts[0],
            num_draft_layers=1,
            pools=[pool.describe(memory=memory.descriptor())],
            parallel=Parallel(tp_size=spec.tp_size, tp_rank=spec.tp_rank),
            lease_seconds=30,
        )
        with (
            KvrouteClient(spec.url, token=spec.token) as client,
            client.keep_lease(DEPLOYMENT, spec.instance, spec.tp_rank, document) as lease,
        ):
            replies.put(("registered", spec.instance, spec.tp_rank, lease.generation, os.getpid()))
            while True:
                command: tuple[Any, ...] = commands.get(timeout=COMMAND_WAIT_S)
                if command[0] == "verify":
                    replies.put(("verified", spec.tp_rank, verify(spec, pool, layouts, command[1])))
                else:
                    lease.stop(deregister=True)
                    replies.put(("stopped", spec.tp_rank))
                    return
    finally:
        del pool
        memory.close()
