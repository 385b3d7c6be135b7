"""The NIXL test deployment: context TP2 -> generation TP1, target + draft in one pool per rank.

Every rank's pool is filled from one logical KV tensor (seeded), sharded by heads by rule 1 as the
planner tests' ground truth writes it (``tests.world.true_heads``), so the receiver can check the
bytes it pulled against the logical tensor, not against the plan.
"""

from __future__ import annotations

import torch

from kvroute.client.pools import KvLayout, Parallel, SharedKvPool
from kvroute.geometry import Kind, Owner
from tests.world import true_heads

DEPLOYMENT = "nixl"
TARGET_HEADS, DRAFT_HEADS = 4, 1
LAYERS, TOKENS, HEAD_DIM, BLOCKS = 4, 4, 16, 8
SEED = 1234


def layouts(tp_size: int) -> tuple[KvLayout, KvLayout]:
    target = KvLayout(
        Kind.HND,
        LAYERS,
        TARGET_HEADS // tp_size,
        TOKENS,
        HEAD_DIM,
        "bfloat16",
        total_kv_heads=TARGET_HEADS,
    )
    draft = KvLayout(
        Kind.HND,
        1,
        DRAFT_HEADS,
        TOKENS,
        HEAD_DIM,
        "bfloat16",
        owner=Owner.DRAFT,
        total_kv_heads=DRAFT_HEADS,
    )
    return target, draft


def logical() -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, layers, 2, heads, tokens, head_dim] for target and draft, identical in every process."""
    generator = torch.Generator().manual_seed(SEED)
    target = torch.randn(BLOCKS, LAYERS, 2, TARGET_HEADS, TOKENS, HEAD_DIM, generator=generator)
    draft = torch.randn(BLOCKS, 1, 2, DRAFT_HEADS, TOKENS, HEAD_DIM, generator=generator)
    return target.to(torch.bfloat16), draft.to(torch.bfloat16)


def parallel(tp_size: int, tp_rank: int) -> Parallel:
    return Parallel(tp_size=tp_size, tp_rank=tp_rank)


def fill_sender(pool: SharedKvPool, tp_size: int, tp_rank: int) -> None:
    """The rank's heads of the logical tensors, by the planner tests' rule 1 (``true_heads``)."""
    target, draft = logical()
    pool.tensors[0].copy_(target[:, :, :, true_heads(TARGET_HEADS, tp_size, tp_rank)])
    pool.tensors[1].copy_(draft[:, :, :, true_heads(DRAFT_HEADS, tp_size, tp_rank)])
