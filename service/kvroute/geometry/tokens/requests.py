"""A request's place on both sides of a transfer: its block lists, token window and state slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.geometry.tokens.ranges import BLOCK_PAIRS, TokenWindow


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request's place on both sides of a transfer, which the client's job submission and its
    NIXL descriptors take alike: the sender's (``src``) and receiver's (``dst``) block lists, the
    tokens they move (``window``; nothing named: ``src[i]`` goes to ``dst[i]``) and, for a model
    with recurrent state, the request's state slot on each side."""

    src: Sequence[int]
    dst: Sequence[int]
    window: TokenWindow = BLOCK_PAIRS
    src_state_slot: int | None = None
    dst_state_slot: int | None = None
