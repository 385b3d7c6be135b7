"""The ``kvroute demo`` deployment: geometry, ground truth and the simulated worker processes.

Context and generation ranks run as separate processes that own POSIX shared-memory pools, as real
workers own their KV cache; kvroute only maps them. The two instances cut tokens into blocks of
different sizes (the generation side's are larger). Context slot ``s`` holds the prompt's tokens
``[s * tpb, (s + 1) * tpb)``, filled with a ground-truth pattern computed from (prompt position,
layer, K/V, global head, element), so a generation rank can check every byte it received for the
heads it holds, whatever block it landed in, without trusting the plan that moved it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from multiprocessing.queues import Queue
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from kvroute.cli.demo_canary import canary_command, pool_slots
from kvroute.client import KvrouteClient
from kvroute.client.memory import ShmPool
from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, rank_document
from kvroute.geometry import Kind, Owner, Spread

DEPLOYMENT = "demo"
COMMAND_WAIT_S = 300.0
M = TypeVar("M")  # the model a worker holds
CACHED_TOKENS = 3  # the generation side already holds the prompt's first tokens


class TensorParallelRoles:
    """A demo model's TP per role (its ``context_tp`` and ``generation_tp`` fields), one rank a
    TP rank; ``label`` names it in the demo's tables. ``has_state``: a request holds a
    recurrent-state slot besides its blocks (so the canary keeps one back too)."""

    __slots__ = ()
    has_state: ClassVar[bool] = False
    context_tp: int
    generation_tp: int

    def tp(self, role: str) -> int:
        return self.context_tp if role == "context" else self.generation_tp

    def ranks(self, role: str) -> int:
        return self.tp(role)

    def label(self, role: str) -> str:
        return f"TP{self.tp(role)}"

    def placement(self, role: str, prompt_tokens: int) -> Spread:
        """Which prompt tokens a rank of ``role`` holds, and where: all, in order (no CP)."""
        return Spread()


@dataclass(frozen=True, slots=True)
class Model(TensorParallelRoles):
    """A model's KV geometry and the two instances' layouts."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int  # context side
    generation_tokens_per_block: int  # a multiple of tokens_per_block: both hold one prompt
    draft_kv_heads: int
    num_slots: int  # context side
    context_tp: int = 4
    generation_tp: int = 2
    dtype: str = "bfloat16"

    @property
    def prompt_tokens(self) -> int:
        """The one prompt the demo moves: every context slot, in order."""
        return self.num_slots * self.tokens_per_block

    def tokens(self, role: str) -> int:
        return self.tokens_per_block if role == "context" else self.generation_tokens_per_block

    def slots(self, role: str) -> int:
        return self.prompt_tokens // self.tokens(role)

    def layouts(self, role: str) -> tuple[KvLayout, KvLayout]:
        tp_size, tokens = self.tp(role), self.tokens(role)

        def layout(owner: Owner, layers: int, kv_heads: int) -> KvLayout:
            heads = heads_of(kv_heads, tp_size, 0)[1]
            shape = (layers, heads, tokens, self.head_dim, self.dtype)
            return KvLayout(Kind.HND, *shape, owner=owner, total_kv_heads=kv_heads)

        target = layout(Owner.TARGET, self.layers, self.kv_heads)
        return target, layout(Owner.DRAFT, 1, self.draft_kv_heads)


# A Llama-3-8B-like target (32 layers, 8 KV heads, head_dim 128) with a one-layer Eagle draft
# holding 2 KV heads; a prompt of 1,536 tokens in 96 context slots of 16 tokens (24 generation
# slots of 64) keeps all six pools under 0.5 GiB.
FULL = Model(
    layers=32,
    kv_heads=8,
    head_dim=128,
    tokens_per_block=16,
    generation_tokens_per_block=64,
    draft_kv_heads=2,
    num_slots=96,
)
SMALL = Model(
    layers=4,
    kv_heads=8,
    head_dim=16,
    tokens_per_block=4,
    generation_tokens_per_block=8,
    draft_kv_heads=2,
    num_slots=12,
)


def heads_of(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first global head, heads held) of a rank, docs/geometry.md rule 1."""
    if tp_size <= total:
        per_rank = total // tp_size
        return tp_rank * per_rank, per_rank
    return tp_rank * total // tp_size, 1


def truth(layout: KvLayout, first_token: int, first_head: int) -> torch.Tensor:
    """The ground-truth int16 words of a block of ``layout`` holding the prompt's tokens from
    ``first_token`` and heads from ``first_head``."""
    layer, kv, head, token, element = (
        torch.arange(n, dtype=torch.int64).view(*([1] * i), n, *([1] * (4 - i)))
        for i, n in enumerate(layout.block_shape)
    )
    owner_salt = 0 if layout.owner is Owner.TARGET else 50_021
    words = (
        (first_token + token) * 1_009
        + (layout.first_layer + layer) * 10_007
        + kv * 101
        + (first_head + head) * 7_919
        + element
        + owner_salt
    ) % 65_521
    return (words - 32_760).to(torch.int16)


def receiver_slot(model: Model, block: int) -> int:
    """Generation slots hold the prompt's blocks in reverse order (lists are never just 0, 1, ..)."""
    return model.slots("generation") - 1 - block


@dataclass(frozen=True, slots=True)
class WorkerSpec(Generic[M]):
    """One demo worker process: where kvroute is, which rank it is, and the model it holds."""

    url: str
    token: str
    role: str
    instance: str
    tp_size: int
    tp_rank: int
    model: M
    shm_name: str


def _pool(spec: WorkerSpec[Model]) -> tuple[ShmPool, SharedKvPool, list[KvLayout]]:
    layouts = list(spec.model.layouts(spec.role))
    slots = pool_slots(spec.model, spec.role)  # the prompt's blocks, then the canary's
    stride = SharedKvPool.carve(layouts, 1).slot_stride
    memory = ShmPool(spec.shm_name, stride * slots)
    memory.tensor.zero_()
    return memory, SharedKvPool.carve(layouts, slots, buffer=memory.tensor), layouts


def _first_heads(spec: WorkerSpec[Model]) -> list[int]:
    model = spec.model
    return [
        heads_of(total, spec.tp_size, spec.tp_rank)[0]
        for total in (model.kv_heads, model.draft_kv_heads)
    ]


def fill(spec: WorkerSpec[Model], pool: SharedKvPool, layouts: list[KvLayout]) -> None:
    tokens = spec.model.tokens_per_block
    for tensor, layout, first in zip(pool.tensors, layouts, _first_heads(spec), strict=True):
        words = tensor.view(torch.int16)
        for block in range(spec.model.num_slots):
            words[block] = truth(layout, block * tokens, first)


def requests(model: Model, jobs: int) -> list[dict[str, Any]]:
    """The prompt after the cached prefix in ``jobs`` token ranges that start mid-block: each names
    the context blocks and the (reverse-ordered) generation blocks that hold its tokens; upstream's
    suffix rule places both lists, so a range may start and end mid-block on either side."""
    start, end = CACHED_TOKENS, model.prompt_tokens
    bounds = [start + (end - start) * job // jobs for job in range(jobs + 1)]
    src_tokens, dst_tokens = model.tokens("context"), model.tokens("generation")
    return [
        {
            "src_blocks": list(range(first // src_tokens, -(-last // src_tokens))),
            "dst_blocks": [
                receiver_slot(model, block)
                for block in range(first // dst_tokens, -(-last // dst_tokens))
            ],
            "tokens": (first, last),
        }
        for first, last in pairwise(bounds)
    ]


def incompatible_document(model: Model) -> dict[str, Any]:
    """A generation rank whose heads are half as wide: kvroute must refuse it (blocks of another
    size would be fine: plans re-cut them)."""
    halved = [
        replace(layout, head_dim=layout.head_dim // 2) for layout in model.layouts("generation")
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
    spec: WorkerSpec[Model], pool: SharedKvPool, layouts: list[KvLayout], jobs: list[dict[str, Any]]
) -> dict[str, int]:
    """Bytes checked and wrong over every slot: the tokens the jobs moved must hold their truth
    (whichever context block they came from), every other token must still be zero."""
    moved = (jobs[0]["tokens"][0], jobs[-1]["tokens"][1])  # consecutive ranges
    checked = wrong = 0
    tokens = spec.model.generation_tokens_per_block
    for tensor, layout, first in zip(pool.tensors, layouts, _first_heads(spec), strict=True):
        words = tensor.view(torch.int16)
        for block in range(spec.model.slots("generation")):
            slot = receiver_slot(spec.model, block)
            expected = truth(layout, block * tokens, first)
            position = torch.arange(tokens) + block * tokens
            outside = (position < moved[0]) | (position >= moved[1])
            expected[..., outside, :] = 0  # [layer, K/V, head, token, element]
            wrong += int((words[slot] != expected).sum()) * 2
            checked += words[slot].numel() * 2
    return {"checked": checked, "wrong": wrong}


def answer_commands(
    spec: WorkerSpec[Any],
    deployment: str,
    document: dict[str, Any],
    queues: tuple[Queue, Queue],
    verify: Callable[[Any], dict[str, int]],
    pool: np.ndarray | None = None,
) -> None:
    """Registers, keeps the lease and answers the demo's commands (verify, canary, then stop)
    on ``queues`` (commands, replies); ``pool`` (the rank's one pool, flat uint8) holds the canary
    (``demo_canary``; None: the demo runs none)."""
    commands, replies = queues
    canary = None if pool is None else partial(canary_command, spec, deployment, pool, document)
    with (
        KvrouteClient(spec.url, token=spec.token) as client,
        client.keep_lease(deployment, spec.instance, spec.tp_rank, document) as lease,
    ):
        replies.put(("registered", spec.instance, spec.tp_rank, lease.generation, os.getpid()))
        while True:
            command: tuple[Any, ...] = commands.get(timeout=COMMAND_WAIT_S)
            if command[0] == "canary" and canary is not None:
                replies.put(canary())
                continue
            if command[0] != "verify":
                lease.stop(deregister=True)
                replies.put(("stopped", spec.tp_rank))
                return
            replies.put(("verified", spec.tp_rank, verify(command[1])))


def rank_doc(
    spec: WorkerSpec[Model],
    pool: SharedKvPool,
    layouts: list[KvLayout],
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The rank's registration document."""
    return rank_document(
        role=spec.role,
        target=layouts[0],
        num_draft_layers=1,
        pools=[pool.describe(memory=memory)],
        parallel=Parallel(tp_size=spec.tp_size, tp_rank=spec.tp_rank),
        lease_seconds=30,
    )


def serve(spec: WorkerSpec[Model], commands: Queue, replies: Queue) -> None:
    """A worker process: own and fill the pool, register and keep the lease, answer commands."""
    memory, pool, layouts = _pool(spec)
    try:
        if spec.role == "context":
            fill(spec, pool, layouts)
        document = rank_doc(spec, pool, layouts, memory.descriptor())
        checks = partial(verify, spec, pool, layouts)
        answer_commands(
            spec, DEPLOYMENT, document, (commands, replies), checks, memory.tensor.numpy()
        )
    finally:
        del pool
        memory.close()
