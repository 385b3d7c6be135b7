"""What a job must name beside its block lists, checked per leg before anything is copied.

A recurrent-state view copies the request's state slot pair once: a plan that moves state needs both
slots, and where a pool's block and state regions share slots (``CopyPlan.shared_slot_pools``) the
state slot must not also be one of the job's block ids there, or one copy would overwrite the other.
A windowed view moves the job's tokens from its window's first token on, which needs the prompt's
length (``prompt_tokens``, else the end of the job's token range).
"""

from __future__ import annotations

import numpy as np

from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.jobs import TransferJob, TransferLeg


def check_leg(job: TransferJob, leg: TransferLeg, leg_index: int) -> None:
    """Refuses by name what ``job`` lacks for the plan of one leg."""
    plan = leg.plan
    if plan.has_state:
        for name in ("src_state_slot", "dst_state_slot"):
            if getattr(job, name) is None:
                raise TransferValidationError(
                    name,
                    f"the plan of leg {leg_index} moves recurrent state (per-request "
                    "slots): give the request's state slot on both sides",
                )
        _check_shared_slots(job, "dst", plan.shared_slot_pools, "receiver pool")
        senders = frozenset(pool for _, pool in plan.shared_src_pools)
        _check_shared_slots(job, "src", senders, "sender pool")
    if plan.windowed and job.window.prompt is None:
        raise TransferValidationError(
            "prompt_tokens",
            f"the plan of leg {leg_index} has sliding-window views: the prompt length "
            "(prompt_tokens, or the end of tokens) says which tokens are in the window",
        )


def _check_shared_slots(job: TransferJob, side: str, shared: frozenset[int], what: str) -> None:
    slot = getattr(job, f"{side}_state_slot")
    blocks = job.src_blocks if side == "src" else job.dst_blocks
    clash = np.flatnonzero(blocks == slot)
    if shared and len(clash):
        raise TransferValidationError(
            f"{side}_state_slot",
            f"slot {slot} is also {side}_blocks[{int(clash[0])}]; {what} {min(shared)} keeps "
            "blocks and request state in the same slots",
        )


def state_slots(job: TransferJob) -> tuple[np.ndarray, np.ndarray]:
    """The request's state slot on each side, as one-element slot arrays (checked present)."""
    src, dst = job.src_state_slot, job.dst_state_slot
    # check_leg refused a job without them
    assert src is not None
    assert dst is not None
    arrays = np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64)
    for array in arrays:
        array.setflags(write=False)
    return arrays
