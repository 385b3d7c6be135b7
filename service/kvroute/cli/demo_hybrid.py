"""The ``kvroute demo --model hybrid`` deployment: a Nemotron-H-like model and its worker processes.

Mamba2 layers and a few attention layers share one shared-memory pool per rank: a slot holds either
a KV block of the attention layers or one request's recurrent state (SSM heads and [x | B | C]
conv channels), as hybrid engines share one page pool. Context TP4 ranks fill each request's blocks
and state slot with a ground-truth pattern of global coordinates (layer, head or channel, ...);
generation TP2 ranks rebuild the pool they must hold from the same pattern and compare every byte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import torch

from kvroute.client import KvrouteClient
from kvroute.client.hybrid import HybridPool, MambaLayout, mamba2
from kvroute.client.memory import ShmPool
from kvroute.client.pools import KvLayout, Parallel, rank_document
from kvroute.geometry import Kind

DEPLOYMENT = "demo-hybrid"
COMMAND_WAIT_S = 300.0
BLOCKS_PER_REQUEST = 3  # each request: its prompt's blocks and one state slot (4 slots)


@dataclass(frozen=True, slots=True)
class HybridModel:
    """Model dimensions (Mamba2 and attention) and the two instances' TP."""

    layers: int
    attention: tuple[int, ...]
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    ssm_heads: int
    ssm_head_dim: int
    d_state: int
    groups: int
    d_conv: int = 4
    jobs: int = 2
    context_tp: int = 4
    generation_tp: int = 2
    dtype: str = "bfloat16"

    @property
    def mamba(self) -> tuple[int, ...]:
        """Nemotron-H's pattern: Mamba2 on the even layers that are not attention, MLPs elsewhere."""
        return tuple(i for i in range(self.layers) if i % 2 == 0 and i not in self.attention)

    @property
    def num_slots(self) -> int:
        return self.jobs * (BLOCKS_PER_REQUEST + 1)

    def layouts(self, tp_size: int, d_state: int | None = None) -> tuple[KvLayout, MambaLayout]:
        kv = KvLayout(Kind.HND, len(self.attention), self.kv_heads // tp_size,
                      self.tokens_per_block, self.head_dim, self.dtype,
                      total_kv_heads=self.kv_heads, layer_ids=self.attention)  # fmt: skip
        mamba = mamba2(self.mamba, tp_size=tp_size, heads=self.ssm_heads,
                       head_dim=self.ssm_head_dim, d_state=d_state or self.d_state,
                       groups=self.groups, d_conv=self.d_conv, dtype=self.dtype)  # fmt: skip
        return kv, mamba

    def requests(self) -> list[dict[str, Any]]:
        """One transfer per request: context slots 4j..4j+2 are its blocks, 4j+3 its state; the
        generation side uses the mirrored slots."""
        mirror = self.num_slots - 1
        requests = []
        for job in range(self.jobs):
            src = list(range(job * 4, job * 4 + BLOCKS_PER_REQUEST))
            requests.append({
                "src_blocks": src, "dst_blocks": [mirror - s for s in src],
                "src_state_slot": job * 4 + 3, "dst_state_slot": mirror - (job * 4 + 3),
                "prompt_tokens": BLOCKS_PER_REQUEST * self.tokens_per_block - 5,
            })  # fmt: skip
        return requests


# Nemotron-H-like at half width: 52 layers, 24 Mamba2 (64 heads of 64 x 128, 8 groups) and 4
# attention layers (8 KV heads, head_dim 128); a context slot holds 6 MiB of request state.
FULL = HybridModel(52, (7, 18, 29, 40), 8, 128, 32, 64, 64, 128, 8)
SMALL = HybridModel(8, (3, 6), 4, 16, 4, 8, 4, 4, 2)


def _word(*coordinates: torch.Tensor | int) -> torch.Tensor:
    """An int16 word from weighted coordinates: any misplaced element reads another value."""
    weights = (1_000_003, 10_007, 4_999, 7_919, 131, 1)
    total = sum(w * c for w, c in zip(weights, coordinates, strict=False))
    return (torch.as_tensor(total) % 65_521 - 32_760).to(torch.int16)


def _grid(*sizes: int) -> list[torch.Tensor]:
    return list(torch.meshgrid(*(torch.arange(n) for n in sizes), indexing="ij"))


def kv_truth(kv: KvLayout, tp_rank: int, block: int) -> torch.Tensor:
    layer, buf, head, token, e = _grid(*kv.block_shape)
    layer_id = torch.tensor(kv.layer_ids or ())[layer]
    return _word(block, layer_id, buf, tp_rank * kv.num_kv_heads + head, token, e)


def ssm_truth(m: MambaLayout, tp_rank: int, request: int) -> torch.Tensor:
    layer, head, d, s = _grid(*m.ssm_shape)
    layer_id = torch.tensor(m.layer_ids)[layer]
    return _word(request + 500, layer_id, d, tp_rank * m.num_heads + head, s)


def conv_truth(m: MambaLayout, tp_rank: int, request: int) -> torch.Tensor:
    sections = []
    for index, channels in enumerate(m.conv_channels):
        layer, c, k = _grid(m.num_layers, channels, m.conv_kernel)
        layer_id = torch.tensor(m.layer_ids)[layer]
        sections.append(_word(request + 700, layer_id, index, tp_rank * channels + c, k))
    return torch.cat(sections, dim=1)


def write_request(pool: HybridPool, tp_rank: int, request: dict[str, Any], side: str) -> None:
    """What a rank holds for a request: on the context side its own blocks and state; on the
    generation side (``dst``) the same logical content in the mirrored slots."""
    blocks, slot = request[f"{side}_blocks"], request[f"{side}_state_slot"]
    assert pool.kv_layout is not None
    assert pool.kv is not None
    # Written through int16 views: bit patterns, never converted as numbers.
    kv, ssm, conv = (tensor.view(torch.int16) for tensor in (pool.kv, pool.ssm, pool.conv))
    for block, logical in zip(blocks, request["src_blocks"], strict=True):
        kv[block] = kv_truth(pool.kv_layout, tp_rank, logical)
    ssm[slot] = ssm_truth(pool.mamba, tp_rank, request["src_state_slot"])
    conv[slot] = conv_truth(pool.mamba, tp_rank, request["src_state_slot"])


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    token: str
    role: str
    instance: str
    tp_size: int
    tp_rank: int
    model: HybridModel
    shm_name: str


def _pool(spec: WorkerSpec) -> tuple[ShmPool, HybridPool]:
    kv, mamba = spec.model.layouts(spec.tp_size)
    stride = HybridPool.carve(kv, mamba, 1).slot_stride
    memory = ShmPool(spec.shm_name, stride * spec.model.num_slots)
    memory.tensor.zero_()
    return memory, HybridPool.carve(kv, mamba, spec.model.num_slots, buffer=memory.tensor)


def document(model: HybridModel, role: str, tp_size: int, tp_rank: int, pool: HybridPool,
             memory: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    assert pool.kv_layout is not None
    return rank_document(
        role=role, target=pool.kv_layout, pools=[pool.describe(memory=memory)],
        parallel=Parallel(tp_size=tp_size, tp_rank=tp_rank, layers_per_stage=(model.layers,)),
    )  # fmt: skip


def incompatible_document(model: HybridModel) -> dict[str, Any]:
    """A generation rank whose SSM state has half the d_state: other bytes per SSM head."""
    pool = HybridPool.carve(*model.layouts(model.generation_tp, d_state=model.d_state // 2), 1)
    return document(model, "generation", model.generation_tp, 0, pool)


def verify(spec: WorkerSpec, pool: HybridPool, requests: list[dict[str, Any]]) -> dict[str, int]:
    """Every byte of the pool against the pool it must be: received requests, zeros elsewhere."""
    expected = HybridPool.carve(pool.kv_layout, pool.mamba, spec.model.num_slots)
    for request in requests:
        write_request(expected, spec.tp_rank, request, "dst")
    wrong = int((pool.buffer != expected.buffer).sum())
    return {"checked": pool.buffer.numel(), "wrong": wrong}


def serve(spec: WorkerSpec, commands: Queue, replies: Queue) -> None:
    """A worker process: own and fill the pool, register and keep the lease, answer commands."""
    memory, pool = _pool(spec)
    try:
        if spec.role == "context":
            for request in spec.model.requests():
                write_request(pool, spec.tp_rank, request, "src")
        doc = document(spec.model, spec.role, spec.tp_size, spec.tp_rank, pool, memory.descriptor())
        with (
            KvrouteClient(spec.url, token=spec.token) as client,
            client.keep_lease(DEPLOYMENT, spec.instance, spec.tp_rank, doc) as lease,
        ):
            replies.put(("registered", spec.instance, spec.tp_rank, lease.generation, os.getpid()))
            while True:
                command: tuple[Any, ...] = commands.get(timeout=COMMAND_WAIT_S)
                if command[0] == "verify":
                    replies.put(("verified", spec.tp_rank, verify(spec, pool, command[1])))
                else:
                    lease.stop(deregister=True)
                    replies.put(("stopped", spec.tp_rank))
                    return
    finally:
        del pool
        memory.close()
