"""The ``kvroute demo --model hybrid`` deployment: a Nemotron-H-like model and its worker processes.

Mamba2 layers and a few attention layers share one shared-memory pool per rank: a slot holds either
a KV block of the attention layers or one request's recurrent state (SSM heads and [x | B | C]
conv channels), as hybrid engines share one page pool. The generation side cuts tokens into blocks
twice as large, so its slots are larger and a request needs fewer of them. Context TP4 ranks fill
each request's blocks and state slot with a ground-truth pattern of global coordinates (request,
layer, head or channel, prompt position, ...); each job moves one request's prompt after a cached
prefix (a token range starting mid-block on both sides) and its state slot once, and generation
TP2 ranks rebuild the pool they must hold from the same pattern and compare every byte. Before any
request moves, the canary (``demo_canary``) attests the path: attention KV in the blocks kept back
at the end of each pool and the recurrent state in the slot just before them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from multiprocessing.queues import Queue
from typing import Any, ClassVar

import torch

from kvroute.cli.demo_canary import canary_kv, pool_slots
from kvroute.cli.demo_workers import TensorParallelRoles, WorkerSpec, answer_commands
from kvroute.client.hybrid import HybridPool, MambaLayout, mamba2
from kvroute.client.integrity import write_canary
from kvroute.client.memory import ShmPool
from kvroute.client.pools import KvLayout, Parallel, rank_document
from kvroute.geometry import Kind

DEPLOYMENT = "demo-hybrid"
BLOCKS_PER_REQUEST = 3  # context blocks of a request's prompt (its last one not full)
CACHED_TOKENS = 3  # the generation side already holds each prompt's first tokens


@dataclass(frozen=True, slots=True)
class HybridModel(TensorParallelRoles):
    """Model dimensions (Mamba2 and attention) and the two instances' TP."""

    has_state: ClassVar[bool] = True
    layers: int
    attention: tuple[int, ...]
    kv_heads: int
    head_dim: int
    tokens_per_block: int  # context side; the generation side's blocks are twice as large
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
    def prompt_tokens(self) -> int:
        return BLOCKS_PER_REQUEST * self.tokens_per_block - 1

    def tokens(self, role: str) -> int:
        return self.tokens_per_block * (1 if role == "context" else 2)

    def blocks(self, role: str) -> int:
        """Blocks of one request's prompt on a side."""
        return -(-self.prompt_tokens // self.tokens(role))

    def slots(self, role: str) -> int:
        """Every request's blocks and its state slot (the pool keeps the canary's after them)."""
        return self.jobs * (self.blocks(role) + 1)

    def layouts(self, role: str, d_state: int | None = None) -> tuple[KvLayout, MambaLayout]:
        tp_size = self.tp(role)
        kv = KvLayout(Kind.HND, len(self.attention), self.kv_heads // tp_size,
                      self.tokens(role), self.head_dim, self.dtype,
                      total_kv_heads=self.kv_heads, layer_ids=self.attention)  # fmt: skip
        mamba = mamba2(self.mamba, tp_size=tp_size, heads=self.ssm_heads,
                       head_dim=self.ssm_head_dim, d_state=d_state or self.d_state,
                       groups=self.groups, d_conv=self.d_conv, dtype=self.dtype)  # fmt: skip
        return kv, mamba

    def requests(self) -> list[dict[str, Any]]:
        """One transfer per request: its prompt after the cached prefix, from its context blocks
        (the whole prompt, listed from token 0) to its generation blocks (upstream's suffix rule),
        and its state slot once. Each side keeps a request's blocks and then its state slot in
        consecutive slots; the generation side numbers them down from its last request slot (the
        canary's slots follow, ``demo_canary.pool_slots``)."""
        src_step, dst_step = self.blocks("context") + 1, self.blocks("generation") + 1
        mirror = self.slots("generation") - 1
        requests = []
        for job in range(self.jobs):
            dst = [mirror - (job * dst_step + b) for b in range(dst_step)]
            requests.append({
                "src_blocks": list(range(job * src_step, (job + 1) * src_step - 1)),
                "dst_blocks": dst[:-1], "tokens": (CACHED_TOKENS, self.prompt_tokens),
                "src_first_token": 0, "src_state_slot": (job + 1) * src_step - 1,
                "dst_state_slot": dst[-1],
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


def kv_truth(kv: KvLayout, tp_rank: int, request: int, first_token: int) -> torch.Tensor:
    """A block of ``request``'s prompt holding its tokens from ``first_token``."""
    layer, buf, head, token, e = _grid(*kv.block_shape)
    layer_id = torch.tensor(kv.layer_ids or ())[layer]
    position = first_token + token
    return _word(request, layer_id, buf, tp_rank * kv.num_kv_heads + head, position, e)


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
    """What a rank holds for a request: on the context side its whole blocks and its state; on the
    generation side (``dst``) the tokens of the job's range in its blocks (the cached prefix and
    the last block's tail stay zero) and the same state, in its own slots."""
    blocks, slot = request[f"{side}_blocks"], request[f"{side}_state_slot"]
    layout, tokens = pool.kv_layout, request["tokens"]
    assert layout is not None
    assert pool.kv is not None
    first = 0 if side == "src" else tokens[0] // layout.tokens_per_block * layout.tokens_per_block
    # Written through int16 views: bit patterns, never converted as numbers.
    kv, ssm, conv = (tensor.view(torch.int16) for tensor in (pool.kv, pool.ssm, pool.conv))
    request_id = request["src_state_slot"]
    for index, block in enumerate(blocks):
        words = kv_truth(layout, tp_rank, request_id, first + index * layout.tokens_per_block)
        if side == "dst":
            position = first + index * layout.tokens_per_block + torch.arange(words.shape[3])
            outside = (position < tokens[0]) | (position >= tokens[1])
            words[:, :, :, outside, :] = 0  # [layer, K/V, head, token, element]
        kv[block] = words
    ssm[slot] = ssm_truth(pool.mamba, tp_rank, request_id)
    conv[slot] = conv_truth(pool.mamba, tp_rank, request_id)


def _pool(spec: WorkerSpec[HybridModel]) -> tuple[ShmPool, HybridPool]:
    kv, mamba = spec.model.layouts(spec.role)
    slots = pool_slots(spec.model, spec.role)  # the requests' slots, then the canary's
    stride = HybridPool.carve(kv, mamba, 1).slot_stride
    memory = ShmPool(spec.shm_name, stride * slots)
    memory.tensor.zero_()
    return memory, HybridPool.carve(kv, mamba, slots, buffer=memory.tensor)


def document(model: HybridModel, role: str, tp_size: int, tp_rank: int, pool: HybridPool,
             memory: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    assert pool.kv_layout is not None
    return rank_document(
        role=role, target=pool.kv_layout, pools=[pool.describe(memory=memory)],
        parallel=Parallel(tp_size=tp_size, tp_rank=tp_rank, layers_per_stage=(model.layers,)),
    )  # fmt: skip


def incompatible_document(model: HybridModel) -> dict[str, Any]:
    """A generation rank whose SSM state has half the d_state: other bytes per SSM head."""
    pool = HybridPool.carve(*model.layouts("generation", d_state=model.d_state // 2), 1)
    return document(model, "generation", model.generation_tp, 0, pool)


def verify(
    spec: WorkerSpec[HybridModel],
    pool: HybridPool,
    doc: dict[str, Any],
    requests: list[dict[str, Any]],
) -> dict[str, int]:
    """Every byte of the pool against the pool it must be: received requests, the canary (which
    ran before them) as this rank's layout holds it (``doc``), zeros elsewhere."""
    expected = HybridPool.carve(pool.kv_layout, pool.mamba, pool.num_slots)
    for request in requests:
        write_request(expected, spec.tp_rank, request, "dst")
    write_canary(canary_kv(spec, DEPLOYMENT, doc, expected.buffer.reshape(-1).numpy()))
    wrong = int((pool.buffer != expected.buffer).sum())
    return {"checked": pool.buffer.numel(), "wrong": wrong}


def serve(spec: WorkerSpec[HybridModel], commands: Queue, replies: Queue) -> None:
    """A worker process: own and fill the pool, register and keep the lease, answer commands."""
    memory, pool = _pool(spec)
    try:
        if spec.role == "context":
            for request in spec.model.requests():
                write_request(pool, spec.tp_rank, request, "src")
        doc = document(spec.model, spec.role, spec.tp_size, spec.tp_rank, pool, memory.descriptor())
        checks = partial(verify, spec, pool, doc)
        answer_commands(spec, DEPLOYMENT, doc, (commands, replies), checks, memory.tensor.numpy())
    finally:
        del pool
        memory.close()
