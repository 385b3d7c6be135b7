"""The ``kvroute demo --model mla-cp`` deployment: a DeepSeek-like MLA model with decode context
parallelism.

Context TP4 without CP: every rank holds the same latent cache (MLA replicates it over TP), blocks of
``tokens_per_block`` prompt tokens. Generation TP1 x CP4 with interleave 1 (vLLM decode context
parallel, ``dcp_kv_cache_interleave_size = 1``): prompt token ``i`` lives on CP rank ``i % 4`` at
local position ``i // 4``, and the four CP ranks share one block list of local blocks, half the
context's size. Each context rank fills its blocks with a ground-truth pattern of (prompt position,
layer, latent element); each job moves a token range after a cached prefix, and every generation
CP rank rebuilds the pool it must hold from the same pattern, independently of kvroute's geometry,
and compares every byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from multiprocessing.queues import Queue
from typing import Any

import torch

from kvroute.cli.demo_canary import pool_slots
from kvroute.cli.demo_workers import TensorParallelRoles, WorkerSpec, answer_commands
from kvroute.client.memory import ShmPool
from kvroute.geometry import Spread

DEPLOYMENT = "demo-mla-cp"
CACHED_TOKENS = 3  # the generation side already holds the prompt's first tokens
ELEMENT_BYTES = 2  # bfloat16


@dataclass(frozen=True, slots=True)
class MlaModel(TensorParallelRoles):
    """MLA dimensions and the two instances' layouts (generation: TP1 x CP ``generation_cp``)."""

    layers: int
    latent: int  # kv_lora_rank + rope dims: one latent row per token and layer
    tokens_per_block: int  # context side
    generation_tokens_per_block: int
    prompt_tokens: int
    context_tp: int = 4
    generation_tp: int = 1
    generation_cp: int = 4
    interleave: int = 1
    jobs: int = 2
    context_cp: int = 1  # > 1: the context ranks hold prefill chunks of each prompt
    context_layout: str = "zigzag"  # ... split this way (contiguous or zigzag)

    def tokens(self, role: str) -> int:
        return self.tokens_per_block if role == "context" else self.generation_tokens_per_block

    def cp(self, role: str) -> int:
        return self.context_cp if role == "context" else self.generation_cp

    def layout(self, role: str) -> str:
        return self.context_layout if role == "context" and self.context_cp > 1 else "interleaved"

    def chunk(self, cp_rank: int) -> torch.Tensor:
        """A context CP rank's prompt positions in local order: torch.tensor_split's chunks (cp of
        them, or 2 cp for zig-zag: rank r takes chunks r and 2 cp - 1 - r), back to back."""
        if self.context_cp == 1:
            return torch.arange(self.prompt_tokens)
        cp, zigzag = self.context_cp, self.context_layout == "zigzag"
        parts = torch.tensor_split(torch.arange(self.prompt_tokens), 2 * cp if zigzag else cp)
        return torch.cat(
            [parts[cp_rank], parts[2 * cp - 1 - cp_rank]] if zigzag else [parts[cp_rank]]
        )

    def ranks(self, role: str) -> int:
        return self.tp(role) * self.cp(role)

    def placement(self, role: str, prompt_tokens: int) -> Spread:
        """A rank's tokens: dealt ``interleave`` at a time, or in chunks of ``prompt_tokens``."""
        cp, layout = self.cp(role), self.layout(role)
        if cp == 1:
            return Spread()
        if layout == "interleaved":
            return Spread(cp, 0, self.interleave)
        return Spread(cp, 0, 1, layout, prompt_tokens)

    def label(self, role: str) -> str:
        cp, layout = self.cp(role), self.layout(role)
        deal = f"interleave {self.interleave}" if layout == "interleaved" else f"{layout} chunks"
        return f"TP{self.tp(role)}" + (f" x CP{cp} ({deal})" if cp > 1 else "")

    def owner(self, position: int) -> tuple[int, int]:
        """(generation CP rank, local position) of a prompt position: chunks of ``interleave``
        tokens dealt round robin."""
        n, cp = self.interleave, self.generation_cp
        return position // n % cp, position // (n * cp) * n + position % n

    def held(self, cp_rank: int, end: int) -> int:
        """Prompt positions before ``end`` that generation CP rank ``cp_rank`` holds."""
        return sum(1 for p in range(end) if self.owner(p)[0] == cp_rank)

    def slots(self, role: str) -> int:
        if role == "context":
            most = max(len(self.chunk(c)) for c in range(self.context_cp))
            return -(-most // self.tokens_per_block)
        return -(-self.held(0, self.prompt_tokens) // self.generation_tokens_per_block)

    def layer_bytes(self, role: str) -> int:
        return self.tokens(role) * self.latent * ELEMENT_BYTES

    def receiver_slot(self, block: int) -> int:
        """Generation local block -> its slot: reverse order, so no slot id equals its block."""
        return self.slots("generation") - 1 - block


# DeepSeek-V3-like: 61 layers of a 576-element latent (512 + 64 rope), a prompt of 1,024 tokens in
# context blocks of 64 and generation blocks of 32 local tokens (128 prompt tokens over CP4).
FULL = MlaModel(61, 576, 64, 32, 1024)
SMALL = MlaModel(4, 32, 8, 4, 40)
# The same with prefill context parallelism: context TP2 x CP2 holding zig-zag chunks.
FULL_ZIGZAG = MlaModel(61, 576, 64, 32, 1024, context_tp=2, context_cp=2)
SMALL_ZIGZAG = MlaModel(4, 32, 8, 4, 42, context_tp=2, context_cp=2)


def requests(model: MlaModel, jobs: int) -> list[dict[str, Any]]:
    """The prompt after the cached prefix in ``jobs`` ranges; each names the context blocks holding
    its tokens and the generation CP ranks' shared local blocks (upstream's suffix rule places
    both lists: the generation list ends with the last local block CP rank 0 needs)."""
    start, end = CACHED_TOKENS, model.prompt_tokens
    bounds = [start + (end - start) * job // jobs for job in range(jobs + 1)]
    src_tokens, dst_tokens = model.tokens("context"), model.tokens("generation")
    last_cp = model.generation_cp - 1
    result = []
    for first, last in pairwise(bounds):
        dst_first = model.held(last_cp, first) // dst_tokens  # the earliest block any rank needs
        dst_end = -(-model.held(0, last) // dst_tokens)
        request: dict[str, Any] = {
            "src_blocks": list(range(first // src_tokens, -(-last // src_tokens))),
            "dst_blocks": [model.receiver_slot(b) for b in range(dst_first, dst_end)],
            "tokens": (first, last),
        }
        if model.context_cp > 1:  # chunks: every context CP rank's whole list, for this prompt
            request.update(
                src_blocks=list(range(model.slots("context"))),
                src_first_token=0,
                prompt_tokens=model.prompt_tokens,
            )
        result.append(request)
    return result


def truth(model: MlaModel, positions: torch.Tensor) -> torch.Tensor:
    """int16 words [layer, token, element] of the latent rows at prompt ``positions``."""
    layer = torch.arange(model.layers).view(-1, 1, 1)
    element = torch.arange(model.latent).view(1, 1, -1)
    words = positions.view(1, -1, 1) * 1_009 + layer * 10_007 + element * 7
    return (words % 65_521 - 32_760).to(torch.int16)


def document(
    model: MlaModel, role: str, rank: int, memory: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The registration document: one pool of blocks, one replicated latent view."""
    tokens, cp = model.tokens(role), model.cp(role)
    layer_bytes = model.layer_bytes(role)
    pool: dict[str, Any] = {
        "pool_id": 0,
        "slot_bytes": layer_bytes * model.layers,
        "num_slots": pool_slots(model, role),  # the requests' slots, then the canary's
    }
    if memory is not None:
        pool["memory"] = memory
    return {
        "role": role,
        "tp_size": model.tp(role),
        "tp_rank": rank // cp % model.tp(role),
        "pp_size": 1,
        "pp_rank": 0,
        "cp_size": cp,
        "cp_rank": rank % cp,
        "cp_layout": model.layout(role),
        "cp_interleave": model.interleave,
        "layers_per_stage": [model.layers],
        "tokens_per_block": tokens,
        "attention": {
            "num_kv_heads": 1,
            "head_dim": model.latent,
            "dtype": "bfloat16",
            "is_mla": True,
        },
        "pools": [pool],
        "views": [
            {
                "view_id": 0,
                "pool_id": 0,
                "kind": "replicated",
                "roles": ["latent"],
                "owner": "target",
                "buffers_per_layer": 1,
                "bytes_per_layer": layer_bytes,
                "dtype": "bfloat16",
                "layers": [
                    {"layer": layer, "offset": layer * layer_bytes} for layer in range(model.layers)
                ],
            }
        ],
        "lease_seconds": 30,
    }


def incompatible_document(model: MlaModel) -> dict[str, Any]:
    """A generation rank dealing prompt tokens in zig-zag prefill chunks: not planned, refused."""
    doc = document(model, "generation", 0)
    doc["cp_layout"] = "zigzag"
    return doc


def _words(pool: torch.Tensor, model: MlaModel, role: str) -> torch.Tensor:
    """The requests' slots of the pool (the canary's follow) as int16 words [slot, layer,
    token, element]."""
    shape = (model.slots(role), model.layers, model.tokens(role), model.latent)
    size = model.slots(role) * model.layers * model.layer_bytes(role)
    return pool[:size].view(torch.int16).view(shape)


def fill(model: MlaModel, pool: torch.Tensor, cp_rank: int) -> None:
    """A context rank's blocks: slot ``s`` holds its local positions [s * tpb, (s + 1) * tpb), the
    prompt positions [s * tpb, (s + 1) * tpb) without CP, else its chunks' (``MlaModel.chunk``)."""
    words, tokens = _words(pool, model, "context"), model.tokens_per_block
    held = model.chunk(cp_rank)
    for block in range(model.slots("context")):
        positions = held[block * tokens : (block + 1) * tokens]
        words[block, :, : len(positions)] = truth(model, positions)


def expected(model: MlaModel, cp_rank: int, moved: tuple[int, int]) -> torch.Tensor:
    """The generation CP rank's pool after the jobs: the moved positions it holds, at their local
    positions in their slots; every other byte zero."""
    size = model.slots("generation") * model.layers * model.layer_bytes("generation")
    words = _words(torch.zeros(size, dtype=torch.uint8), model, "generation")
    tokens = model.generation_tokens_per_block
    for position in range(*moved):
        rank, local = model.owner(position)
        if rank == cp_rank:
            slot = model.receiver_slot(local // tokens)
            words[slot, :, local % tokens] = truth(model, torch.tensor([position]))[:, 0]
    return words


def verify(
    spec: WorkerSpec[MlaModel], pool: torch.Tensor, jobs: list[dict[str, Any]]
) -> dict[str, int]:
    model = spec.model
    moved = (jobs[0]["tokens"][0], jobs[-1]["tokens"][1])  # consecutive ranges
    want = expected(model, spec.tp_rank % model.generation_cp, moved)
    got = _words(pool, model, "generation")
    return {"checked": got.numel() * 2, "wrong": int((got != want).sum()) * 2}


def serve(spec: WorkerSpec[MlaModel], commands: Queue, replies: Queue) -> None:
    """A worker process (``spec.tp_rank`` is its rank number): own and fill the pool, register
    and keep the lease, answer commands."""
    model = spec.model
    size = pool_slots(model, spec.role) * model.layers * model.layer_bytes(spec.role)
    memory = ShmPool(spec.shm_name, size)
    try:
        pool = memory.tensor
        pool.zero_()
        if spec.role == "context":
            fill(model, pool, spec.tp_rank % model.context_cp)
        doc = document(model, spec.role, spec.tp_rank, memory.descriptor())
        verified = partial(verify, spec, pool)
        answer_commands(spec, DEPLOYMENT, doc, (commands, replies), verified, pool.numpy())
    finally:
        del pool
        memory.close()
