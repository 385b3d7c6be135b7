"""What a transfer job is, and the states it moves through.

A job copies one request for one or more receiver ranks of the same sender instance: each
``TransferLeg`` is one receiver rank's plan with the pool memories it needs already opened (so a pool
that cannot be opened fails the request up front, not a queued job later). The block lists are
normalised to read-only ``int64`` arrays once, at construction.

With an empty ``geometry.TokenWindow`` (the default) the lists pair up one to one (block
``src_blocks[i]`` to ``dst_blocks[i]``), as before token ranges existed. Otherwise each list holds a
run of the prompt (``geometry.ranges``): the window names the token range to move, optionally the first token of each list, and the prompt's
length that sliding windows are measured from; a view pair planned by period is moved that way even
without a window (both lists then start at token 0). A window naming only the prompt's length keeps
the lists the prompt's last blocks (issue 12's jobs) and moves the tokens both hold up to the
prompt's last token, whatever the block sizes; windowed view pairs skip their stale leading blocks.

Recurrent-state views copy the request's ``src_state_slot`` (the same on every sender rank, as block
ids are) to its ``dst_state_slot`` once, whatever the block sizes and the token range; both are
required when a leg's plan moves state.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.geometry import (
    BLOCK_PAIRS,
    BlockList,
    Spread,
    TokenRange,
    TokenRangeError,
    TokenWindow,
)
from kvroute.job_state import JobState
from kvroute.transfer.errors import PoolMemoryError, TransferValidationError
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


def _check_int(name: str, value: object, low: int) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low
    ):
        raise TransferValidationError(name, f"must be an integer >= {low}, got {value!r}")


def validation_error(error: TokenRangeError) -> TransferValidationError:
    """A geometry refusal of a range or a list as the data plane's error: a gap and a contradicted
    prompt keep their own codes and members, anything else is a request that can never copy."""
    code = "invalid_transfer" if error.code == TokenRangeError.code else error.code
    return TransferValidationError(error.field, error.detail, code=code, extras=dict(error.extras))


@dataclass(frozen=True, slots=True, eq=False, init=False)
class TransferJob:
    """Copy one request from every sender to the receiver, for each leg: ``src_blocks[i]`` to
    ``dst_blocks[i]``, or the tokens ``window`` names, and the request's state
    slot pair for recurrent-state views (see the module docstring)."""

    legs: tuple[TransferLeg, ...]
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    job_id: str
    window: TokenWindow
    src_state_slot: int | None
    dst_state_slot: int | None

    def __init__(
        self,
        legs: Sequence[TransferLeg],
        src_blocks: Sequence[int] | np.ndarray,
        dst_blocks: Sequence[int] | np.ndarray,
        job_id: str | None = None,
        *,
        window: TokenWindow = BLOCK_PAIRS,
        src_state_slot: int | None = None,
        dst_state_slot: int | None = None,
    ) -> None:
        src, dst = _blocks(src_blocks, "src_blocks"), _blocks(dst_blocks, "dst_blocks")
        if not legs:
            raise TransferValidationError("receiver_ranks", "a job needs at least one leg")
        _check_int("src_state_slot", src_state_slot, 0)
        _check_int("dst_state_slot", dst_state_slot, 0)
        object.__setattr__(self, "legs", tuple(legs))
        object.__setattr__(self, "src_blocks", src)
        object.__setattr__(self, "dst_blocks", dst)
        object.__setattr__(self, "job_id", job_id or str(uuid.uuid4()))
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "src_state_slot", src_state_slot)
        object.__setattr__(self, "dst_state_slot", dst_state_slot)

    def lists(
        self, src_tokens: int, dst_tokens: int, spreads: tuple[Spread, Spread]
    ) -> tuple[TokenRange, BlockList, BlockList]:
        """The window's range and both block lists for one view pair's block sizes (and CP
        placements), a refusal as the data plane's error."""
        try:
            return self.window.lists(
                self.src_blocks.tolist(), self.dst_blocks.tolist(), src_tokens, dst_tokens, spreads
            )
        except TokenRangeError as error:
            raise validation_error(error) from error

    @property
    def num_blocks(self) -> int:
        """Receiver blocks the job names."""
        return len(self.dst_blocks)

    def verify_memory(self) -> None:
        """Re-checks every pool the job touches; the worker calls it right before copying.

        Raises ``PoolMemoryError`` naming the side and the pool (a segment that shrank, changed
        owner or was replaced since the job was accepted), so the job fails instead of the process.
        """
        for leg in self.legs:
            for (rank, _), memory in leg.src_pools.items():
                _verify(memory, f"sender rank {rank}")
            for memory in leg.dst_pools.values():
                _verify(memory, "receiver")


def _verify(memory: PoolMemory, side: str) -> None:
    try:
        memory.verify()
    except PoolMemoryError as error:
        raise PoolMemoryError(
            error.pool_id, error.backend, f"{side}: {error.reason} (checked as the job started)"
        ) from None


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
    submitted_at: float = 0.0  # epoch seconds, from the worker pool's clock
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
