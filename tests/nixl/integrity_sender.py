"""A context rank for the integrity tests, in its own process: the NIXL sender of
``tests.nixl.sender`` that also writes the canary, digests a request's blocks (and state slot) as it
produced them, flips a bit of its pool on command (a fault after the write) and hands back its
kernels' bytes (the test's ground truth)."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

import torch

from kvroute.client import KvrouteClient
from kvroute.client.integrity import reserved_blocks, reserved_state_slot, write_canary
from kvroute.client.kv_digest import kv_digest
from kvroute.client.kv_rows import RequestKv, window_firsts
from kvroute.geometry import RankRegistration
from tests.nixl import world
from tests.nixl.sender import SenderRank

WAIT_S = 120.0


def serve(
    url: str,
    token: str,
    tp_size: int,
    tp_rank: int,
    shm_name: str,
    commands: Queue,
    replies: Queue,
    hybrid: bool = False,
) -> None:
    rank = SenderRank.open(tp_size, tp_rank, shm_name, hybrid=hybrid)
    reg = RankRegistration.from_json(
        rank.document, deployment=world.DEPLOYMENT, instance="ctx0", rank=tp_rank
    )
    pools = {i: rank.carved.flat(i).numpy() for i in range(len(rank.carved.pools))}
    try:
        with KvrouteClient(url, token=token) as client:
            client.register(world.DEPLOYMENT, "ctx0", tp_rank, rank.document)
            replies.put(("registered", tp_rank))
            while (command := commands.get(timeout=WAIT_S))[0] != "stop":
                replies.put(_answer(command, reg, pools, rank.carved.tensors))
    finally:
        del pools
        rank.close()


def _answer(
    command: tuple[Any, ...],
    reg: RankRegistration,
    pools: dict[int, Any],
    tensors: dict[str, torch.Tensor],
) -> tuple[Any, ...]:
    if command[0] == "canary":
        tokens = range(command[1])
        slot = reserved_state_slot(reg, tokens)
        write_canary(RequestKv(reg, pools, reserved_blocks(reg, tokens), tokens, state_slot=slot))
        return ("written",)
    if command[0] == "digest":  # a windowed view from its own window on (the producer's rule)
        _, blocks, first, stop, chunk, state_slot = command
        kv = RequestKv(reg, pools, blocks, range(first, stop), window_firsts(reg, stop), state_slot)
        digest = kv_digest(kv, chunk)
        return ("digest", digest.to_json())
    # ``tensors[name][index]``: one row of a kernel's typed view, e.g. [block, layer, K/V, head,
    # token] of an attention tensor or [slot, layer, SSM head, head dim] of the SSM state.
    _, name, index, *element = command
    row = tensors[name][index]
    if command[0] == "flip":  # the low bit of the element's low byte (16-bit elements)
        row.view(torch.int16)[element[0]] ^= 1
        return ("flipped",)
    if command[0] == "bytes":
        return ("bytes", row.contiguous().view(torch.uint8).numpy().copy())
    raise ValueError(f"unknown command {command!r}")
