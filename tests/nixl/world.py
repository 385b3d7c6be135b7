"""The NIXL test deployments: context TP2 -> generation TP1.

Dense (``carve(tp, hybrid=False)``): target + draft in one pool per rank. Every rank's pool is
filled from one logical KV tensor (seeded), sharded by heads by rule 1 as the planner tests' ground
truth writes it (``tests.world.true_heads``), so the receiver can check the bytes it pulled against
the logical tensor, not against the plan.

Hybrid (``hybrid=True``): full attention (layer 2) and a ``WINDOW``-token sliding window (layer 5)
side by side in each block of pool 0, Mamba2 state (layers 0, 1, 3, 4: SSM heads, conv sections
x | B | C) in a state pool of its own (pool 1), both pools in one buffer: no view shares another's
bytes. A context rank's buffer is random bytes (seeded by rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvroute.client.hybrid import HybridPool, mamba2
from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, rank_document
from kvroute.geometry import Kind, Owner
from tests.world import true_heads

DEPLOYMENT = "nixl"
TARGET_HEADS, DRAFT_HEADS = 4, 1
LAYERS, TOKENS, HEAD_DIM, BLOCKS = 4, 4, 16, 8
SEED = 1234
# The hybrid: layers 0-5, Mamba2 on MAMBA (4 SSM heads of 8 x 8; conv x of 32 channels, B and C of
# 16, 3 columns), full attention on FULL, a WINDOW-token window on SLIDING.
MAMBA, FULL, SLIDING, HYBRID_LAYERS, WINDOW = (0, 1, 3, 4), 2, 5, 6, 6
SSM_HEADS, SSM_HEAD_DIM, D_STATE, GROUPS, D_CONV = 4, 8, 8, 2, 4


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


@dataclass
class Carved:
    """A rank's pools in one uint8 buffer (pool ``i`` from byte ``offsets[i]``, ``BLOCKS`` slots
    each), its kernels' typed views by name (``tensors``) and the layout its document's attention
    defaults come from."""

    buffer: torch.Tensor
    pools: list[SharedKvPool | HybridPool]
    offsets: list[int]
    target: KvLayout
    tensors: dict[str, torch.Tensor]
    hybrid: bool

    @property
    def nbytes(self) -> int:
        return self.offsets[-1] + self.flat(len(self.pools) - 1).numel()

    def flat(self, pool: int) -> torch.Tensor:
        """Pool ``pool``'s bytes, flat."""
        size = self.pools[pool].slot_stride * BLOCKS
        return self.buffer[self.offsets[pool] : self.offsets[pool] + size]

    def document(
        self,
        role: str,
        parallel: Parallel | None = None,
        memory: Callable[[int], Mapping[str, Any]] | None = None,
        **members: Any,
    ) -> dict[str, Any]:
        """The rank's registration (``memory(offset)``: a pool's memory descriptor)."""
        pools = [
            pool.describe(i, None if memory is None else memory(self.offsets[i]))
            for i, pool in enumerate(self.pools)
        ]
        parallel = parallel or Parallel()
        if self.hybrid:
            parallel = replace(parallel, layers_per_stage=(HYBRID_LAYERS,))
        return rank_document(role=role, target=self.target, pools=pools, parallel=parallel,
                             num_draft_layers=0 if self.hybrid else 1, **members)  # fmt: skip


def hybrid_layouts(tp_size: int) -> tuple[KvLayout, KvLayout]:
    """Full attention and the window, each one layer of ``TARGET_HEADS`` split over the TP."""
    full = KvLayout(Kind.HND, 1, TARGET_HEADS // tp_size, TOKENS, HEAD_DIM, "bfloat16",
                    total_kv_heads=TARGET_HEADS, layer_ids=(FULL,))  # fmt: skip
    return full, replace(full, layer_ids=(SLIDING,), sliding_window=WINDOW)


def carve(tp_size: int, *, hybrid: bool = False, buffer: torch.Tensor | None = None) -> Carved:
    """A rank's pools at TP ``tp_size``, in ``buffer`` (or a new zeroed one)."""
    if not hybrid:
        target, draft = layouts(tp_size)
        pool = SharedKvPool.carve([target, draft], BLOCKS, buffer=buffer)
        tensors = {"target": pool.tensors[0], "draft": pool.tensors[1]}
        return Carved(pool.buffer.reshape(-1), [pool], [0], target, tensors, False)
    full, window = hybrid_layouts(tp_size)
    mamba = mamba2(MAMBA, tp_size=tp_size, heads=SSM_HEADS, head_dim=SSM_HEAD_DIM,
                   d_state=D_STATE, groups=GROUPS, d_conv=D_CONV)  # fmt: skip
    blocks = SharedKvPool.carve([full, window], BLOCKS)
    state = HybridPool.carve(None, mamba, BLOCKS)
    size = blocks.slot_stride * BLOCKS
    if buffer is None:
        buffer = torch.zeros(size + state.slot_stride * BLOCKS, dtype=torch.uint8)
    blocks = SharedKvPool.carve([full, window], BLOCKS, buffer=buffer[:size])
    state = HybridPool.carve(None, mamba, BLOCKS, buffer=buffer[size:])
    tensors = {"full": blocks.tensors[0], "window": blocks.tensors[1], "ssm": state.ssm,
               "conv": state.conv}  # fmt: skip
    return Carved(buffer, [blocks, state], [0, size], full, tensors, True)


def logical() -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, layers, 2, heads, tokens, head_dim] for target and draft, identical in every process."""
    generator = torch.Generator().manual_seed(SEED)
    target = torch.randn(BLOCKS, LAYERS, 2, TARGET_HEADS, TOKENS, HEAD_DIM, generator=generator)
    draft = torch.randn(BLOCKS, 1, 2, DRAFT_HEADS, TOKENS, HEAD_DIM, generator=generator)
    return target.to(torch.bfloat16), draft.to(torch.bfloat16)


def parallel(tp_size: int, tp_rank: int) -> Parallel:
    return Parallel(tp_size=tp_size, tp_rank=tp_rank)


def fill_sender(carved: Carved, tp_size: int, tp_rank: int) -> None:
    """Dense: the rank's heads of the logical tensors, by the planner tests' rule 1
    (``true_heads``). Hybrid: random bytes, seeded by rank."""
    if carved.hybrid:
        generator = torch.Generator().manual_seed(SEED + tp_rank)
        noise = torch.randint(0, 256, carved.buffer.shape, generator=generator, dtype=torch.uint8)
        carved.buffer.copy_(noise)
        return
    target, draft = logical()
    carved.tensors["target"].copy_(target[:, :, :, true_heads(TARGET_HEADS, tp_size, tp_rank)])
    carved.tensors["draft"].copy_(draft[:, :, :, true_heads(DRAFT_HEADS, tp_size, tp_rank)])
