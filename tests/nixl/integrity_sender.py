"""A context rank for the integrity tests, in its own process: the NIXL sender of
``tests.nixl.sender`` that also writes the canary, digests a request's blocks as it produced them,
and flips a byte of its pool on command (a fault after the write)."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

import torch

from kvroute.client import KvrouteClient
from kvroute.client.integrity import reserved_blocks, write_canary
from kvroute.client.kv_digest import kv_digest
from kvroute.client.pools import SharedKvPool
from kvroute.geometry import RankRegistration
from tests.nixl import world
from tests.nixl.sender import SenderRank

WAIT_S = 120.0


def serve(
    url: str, token: str, tp_size: int, tp_rank: int, shm_name: str, commands: Queue, replies: Queue
) -> None:
    rank = SenderRank.open(tp_size, tp_rank, shm_name)
    reg = RankRegistration.from_json(
        rank.document, deployment=world.DEPLOYMENT, instance="ctx0", rank=tp_rank
    )
    pools = {0: rank.flat.numpy()}
    try:
        with KvrouteClient(url, token=token) as client:
            client.register(world.DEPLOYMENT, "ctx0", tp_rank, rank.document)
            replies.put(("registered", tp_rank))
            while (command := commands.get(timeout=WAIT_S))[0] != "stop":
                replies.put(_answer(command, reg, pools, rank.pool))
    finally:
        del pools
        rank.close()


def _answer(
    command: tuple[Any, ...], reg: RankRegistration, pools: dict[int, Any], pool: SharedKvPool
) -> tuple[Any, ...]:
    if command[0] == "canary":
        tokens = range(command[1])
        write_canary(reg, pools, reserved_blocks(reg, tokens), tokens)
        return ("written",)
    if command[0] == "digest":
        _, blocks, first, stop, chunk = command
        return ("digest", kv_digest(reg, pools, blocks, range(first, stop), chunk).to_json())
    if command[0] == "flip":
        # [block, layer, K/V, head, token] of the target tensor, then the element's low byte.
        _, (block, layer, kv, head, token, element) = command
        words = pool.tensors[0][block, layer, kv, head, token].view(torch.int16)
        words[element] ^= 1
        return ("flipped",)
    raise ValueError(f"unknown command {command!r}")
