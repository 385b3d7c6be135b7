"""What a transfer job is, and the states it moves through.

A job copies one set of block pairs for one or more receiver ranks of the same sender instance:
each ``TransferLeg`` is one receiver rank's plan with the pool memories it needs already opened (so
a pool that cannot be opened fails the request up front, not a queued job later). The block lists are
normalised to read-only ``int64`` arrays once, at construction.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.job_state import JobState
from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.memory import PoolMemory
from kvroute.transfer.plan import CopyPlan


@dataclass(frozen=True, slots=True)
class TransferLeg:
    """One receiver rank's plan, with its senders' pools keyed by (sender rank, pool id)."""

    plan: CopyPlan
    src_pools: Mapping[tuple[int, int], PoolMemory]
    dst_pools: Mapping[int, PoolMemory]


def _blocks(blocks: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(blocks)
    if array.ndim != 1 or len(array) == 0 or array.dtype.kind not in "iu":
        raise TransferValidationError(name, "must be a non-empty list of integer block ids")
    array = array.astype(np.int64)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True, eq=False, init=False)
class TransferJob:
    """Copy ``src_blocks[i]`` of every sender to ``dst_blocks[i]`` of the receiver, for each leg.

    A job moves one request. Its block lists are the last blocks of the request's prompt (a cached
    prefix is implicit in a shorter list); windowed views copy only those holding a token the
    next token attends to, which needs ``prompt_tokens``. Recurrent-state views copy the
    request's ``src_state_slot`` (the same on every sender rank, as block ids are) to its
    ``dst_state_slot`` once. Both are required when a leg's plan moves state and are ignored
    otherwise.
    """

    legs: tuple[TransferLeg, ...]
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    job_id: str
    src_state_slot: int | None
    dst_state_slot: int | None
    prompt_tokens: int | None

    def __init__(
        self,
        legs: Sequence[TransferLeg],
        src_blocks: Sequence[int] | np.ndarray,
        dst_blocks: Sequence[int] | np.ndarray,
        job_id: str | None = None,
        *,
        src_state_slot: int | None = None,
        dst_state_slot: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        src, dst = _blocks(src_blocks, "src_blocks"), _blocks(dst_blocks, "dst_blocks")
        if len(src) != len(dst):
            raise TransferValidationError(
                "dst_blocks", f"has {len(dst)} ids but src_blocks has {len(src)}; they pair up"
            )
        if not legs:
            raise TransferValidationError("receiver_ranks", "a job needs at least one leg")
        for name, value in (
            ("src_state_slot", src_state_slot),
            ("dst_state_slot", dst_state_slot),
            ("prompt_tokens", prompt_tokens),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0
            ):
                raise TransferValidationError(name, f"must be an integer >= 0, got {value!r}")
        object.__setattr__(self, "legs", tuple(legs))
        object.__setattr__(self, "src_blocks", src)
        object.__setattr__(self, "dst_blocks", dst)
        object.__setattr__(self, "job_id", job_id or str(uuid.uuid4()))
        object.__setattr__(self, "src_state_slot", src_state_slot)
        object.__setattr__(self, "dst_state_slot", dst_state_slot)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class CopyResult:
    bytes: int
    fragments: int  # fragments x blocks (x 1 state slot for state views)


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A snapshot of one job, the shape ``GET /v1/transfers/{id}`` reports."""

    job_id: str
    state: JobState
    bytes: int = 0
    fragments: int = 0
    seconds: float | None = None
    error: str | None = None
    submitted_at: float = 0.0  # time.time() stamps
    started_at: float | None = None
    finished_at: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.job_id,
            "state": self.state.value,
            "bytes": self.bytes,
            "fragments": self.fragments,
            "duration_seconds": self.seconds,
            "error": self.error,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }
