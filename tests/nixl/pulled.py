"""Descriptor tests' sender pools and memcpy: the truth's bytes placed in made-up addresses, and
every descriptor pair of a transfer applied to a receiver pool."""

from __future__ import annotations

import numpy as np

from kvroute.client.nixl_descs import NixlTransfer, PoolAddress
from tests.truth import Truth
from tests.world import Layout, Side


def base(rank: int) -> int:
    """Where sender rank ``rank``'s pool 0 lies in the made-up address space of these tests."""
    return (rank + 1) << 32


def place_senders(
    truth: Truth, side: Side, layouts: list[Layout], blocks: list[int]
) -> tuple[dict[int, dict[int, np.ndarray]], dict[int, dict[int, PoolAddress]]]:
    """Sender pools holding the prompt from token 0 in ``blocks`` (the truth's bytes), and their
    addresses."""
    tokens = side.tokens_per_block
    placement = {slot: i * tokens for i, slot in enumerate(blocks)}
    pools = {
        rank: truth.place(side, layout, rank, placement) for rank, layout in enumerate(layouts)
    }
    addresses = {
        rank: {0: PoolAddress(base(rank), layout.pools[0][1], layout.pools[0][2])}
        for rank, layout in enumerate(layouts)
    }
    return pools, addresses


def pulled(
    result: NixlTransfer, senders: dict[int, dict[int, np.ndarray]], into: np.ndarray
) -> np.ndarray:
    """A copy of the receiver's pool 0 ``into`` after every descriptor pair copied its bytes."""
    got = into.copy()
    for descs in result.peers:
        for (dst, length, _), (src, _, _) in zip(descs.local, descs.remote, strict=True):
            offset = src - base(descs.rank)
            got[dst : dst + length] = senders[descs.rank][0][offset : offset + length]
    return got
