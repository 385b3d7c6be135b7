"""Which slots a job copies for each view of one leg, and the checks on them.

A block view copies the job's block pairs; a windowed one only those from its window on, given the
prompt length (``kvroute.geometry.window``: the lists are the last blocks of the prompt). A
recurrent-state view copies the request's state slot pair once. Everything a request can get
wrong here is refused by name before anything is copied: a plan that moves state without the
state slots, a windowed plan without the prompt length or with more blocks than the prompt has,
an id outside its pool, and a state slot that is also a block id in a pool whose block and state
regions share slots.
"""

from __future__ import annotations

import numpy as np

from kvroute.geometry.window import window_skip
from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.jobs import TransferJob, TransferLeg
from kvroute.transfer.memory import PoolMemory
from kvroute.transfer.plan import ViewCopy

STATE = -1  # the selection of state views; block views select by how many leading blocks they skip


def _readonly(values: list[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.int64)
    array.setflags(write=False)
    return array


class JobSlots:
    """The slot selections of one leg of a job; construction checks the job against the plan."""

    def __init__(self, job: TransferJob, leg: TransferLeg, leg_index: int) -> None:
        self._job = job
        plan = leg.plan
        self._state: tuple[np.ndarray, np.ndarray] | None = None
        if plan.has_state:
            for name in ("src_state_slot", "dst_state_slot"):
                if getattr(job, name) is None:
                    raise TransferValidationError(
                        name,
                        f"the plan of leg {leg_index} moves recurrent state (per-request "
                        "slots): give the request's state slot on both sides",
                    )
            self._check_shared_slots("dst", plan.shared_slot_pools, "receiver pool")
            senders = sorted(pool for _, pool in plan.shared_src_pools)
            self._check_shared_slots("src", frozenset(senders), "sender pool")
            self._state = (_readonly([job.src_state_slot]), _readonly([job.dst_state_slot]))
        if plan.windowed and job.prompt_tokens is None:
            raise TransferValidationError(
                "prompt_tokens",
                f"the plan of leg {leg_index} has sliding-window views: the prompt length says "
                "which blocks are in the window",
            )
        self._skips: dict[tuple[int, int], int] = {}

    def _check_shared_slots(self, side: str, shared: frozenset[int], what: str) -> None:
        slot = getattr(self._job, f"{side}_state_slot")
        blocks = self._job.src_blocks if side == "src" else self._job.dst_blocks
        clash = np.flatnonzero(blocks == slot)
        if shared and len(clash):
            raise TransferValidationError(
                f"{side}_state_slot",
                f"slot {slot} is also {side}_blocks[{int(clash[0])}]; {what} {min(shared)} keeps "
                "blocks and request state in the same slots",
            )

    def skip(self, view: ViewCopy) -> int:
        """Leading entries of the block lists outside the view's window (0 without a window)."""
        if view.window is None:
            return 0
        key = (view.window.tokens, view.window.tokens_per_block)
        if key not in self._skips:
            job = self._job
            assert job.prompt_tokens is not None  # checked at construction
            try:
                self._skips[key] = window_skip(*key, job.prompt_tokens, job.num_blocks)
            except ValueError as error:
                raise TransferValidationError("src_blocks", str(error)) from None
        return self._skips[key]

    def select(self, view: ViewCopy) -> tuple[int, np.ndarray, np.ndarray]:
        """(selection key, source slots, destination slots) the view copies."""
        if view.state:
            assert self._state is not None  # a plan with state views has_state
            return STATE, *self._state
        skip = self.skip(view)
        return skip, self._job.src_blocks[skip:], self._job.dst_blocks[skip:]

    def check(self, view: ViewCopy, memory: PoolMemory, where: str, side: str) -> None:
        """Every slot the view addresses on ``side`` ("src" or "dst") lies inside its pool."""
        _, src, dst = self.select(view)
        slots = src if side == "src" else dst
        bad = np.flatnonzero((slots < 0) | (slots >= memory.pool.num_slots))
        if not len(bad):
            return
        index = int(bad[0])
        if view.state:
            name, what = f"{side}_state_slot", "state slot"
        else:
            name, what = f"{side}_blocks[{index + self.skip(view)}]", "block id"
        raise TransferValidationError(
            name,
            f"{what} {int(slots[index])} is outside {where} (num_slots {memory.pool.num_slots})",
        )
