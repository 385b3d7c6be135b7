"""The data-plane tests' pools: worlds of the shared ground truth laid on byte pools.

A scenario is a world of ``tests/world.py`` (view classes, a context and a generation side, one
receiver rank): every rank's layout is the world's, the plan is the planner's for that receiver
compiled for the copy engine, and where each head and token lives is ``tests/truth.py``'s. Sender
slot ``s`` holds logical block ``s``: every byte a logical id names holds that id as one byte value
(``as_bytes``, a mix of the whole id, so a byte of another token, layer, buffer or head shows up as
a mismatch), every other byte is seeded filler that must never move. The receiver expects the
truth's bytes of the block pairs moved laid over its previous contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvroute.geometry import Pool, RankRegistration, build_plan
from kvroute.transfer import CopyPlan
from tests.truth import Truth
from tests.world import Layout, Side, ViewClass, instance

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the id's top byte after the multiply


def as_bytes(ids: np.ndarray) -> np.ndarray:
    """A byte per logical id that changes with every bit of it; 0 stays 0 (unwritten), and no
    logical id's byte is 0."""
    mixed = ids.astype(np.uint64) * GOLDEN
    return np.where(ids == 0, 0, (mixed >> np.uint64(56)) | np.uint64(1)).astype(np.uint8)


@dataclass(frozen=True)
class Scenario:
    """Sender ranks of ``ctx`` copying into generation rank ``receiver``, one pool per rank."""

    name: str
    classes: list[ViewClass]
    ctx: Side
    gen: Side
    receiver: int = 0
    offset: int = 0  # byte offset of slot 0 inside every segment

    @cached_property
    def _senders(self) -> tuple[list[RankRegistration], list[Layout]]:
        return instance(self.ctx, self.classes, "ctx")

    @cached_property
    def _receiver(self) -> tuple[RankRegistration, Layout]:
        regs, layouts = instance(self.gen, self.classes, "gen")
        return regs[self.receiver], layouts[self.receiver]

    @property
    def sender_ranks(self) -> range:
        return range(self.ctx.ranks)

    @property
    def src_slots(self) -> int:
        return self.ctx.num_slots

    @property
    def dst_slots(self) -> int:
        return self.gen.num_slots

    def plan(self) -> CopyPlan:
        return CopyPlan.from_plan(build_plan(self._senders[0], self._receiver[0]))

    def src_pool(self, rank: int) -> Pool:
        return _pool(self._senders[1][rank])

    @property
    def dst_pool(self) -> Pool:
        return _pool(self._receiver[1])

    def sender_bytes(self, rank: int, filler: np.ndarray) -> np.ndarray:
        """Sender ``rank``'s pool: slot ``s`` holding logical block ``s``, ``filler`` elsewhere."""
        layout, slots = self._senders[1][rank], list(range(self.src_slots))
        ids = Truth(self.classes).fill(self.ctx, layout, rank, slots, slots)[0]
        return _laid_over(filler, ids)

    def expected(
        self, before: np.ndarray, blocks: tuple[Sequence[int], Sequence[int]]
    ) -> np.ndarray:
        """The receiver's pool once each ``blocks[0][i]`` moved to ``blocks[1][i]``."""
        src, dst = (list(map(int, side)) for side in blocks)
        ids = Truth(self.classes).fill(self.gen, self._receiver[1], self.receiver, dst, src)[0]
        return _laid_over(before, ids)


def _pool(layout: Layout) -> Pool:
    ((pool_id, (slot_bytes, stride, slots)),) = layout.pools.items()
    return Pool(pool_id, slot_bytes, stride, slots)


def _laid_over(bytes_: np.ndarray, ids: np.ndarray) -> np.ndarray:
    out = bytes_.copy()
    named = ids != 0
    out[named] = as_bytes(ids[named])
    return out
