"""The copy engine against the shared ground truth (``tests/truth.py``), for every strategy and
layout."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvroute.geometry import Pool
from kvroute.transfer import CopyEngine, Strategy, TransferJob, TransferValidationError
from kvroute.transfer.engine import block_spans
from tests.transfer.conftest import SCENARIOS, Staged

Stage = Callable[..., Staged]


def random_blocks(staged: Staged, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scenario = staged.scenario
    return (
        rng.choice(scenario.src_slots, count, replace=False),
        rng.choice(scenario.dst_slots, count, replace=False),
    )


def check_receiver(staged: Staged, blocks: tuple[np.ndarray, np.ndarray]) -> None:
    expected = staged.scenario.expected(staged.receiver_before, blocks)
    actual = staged.receiver.tensor.numpy()
    wrong = np.flatnonzero(actual != expected)
    assert len(wrong) == 0, f"{len(wrong)} receiver bytes differ, first at {wrong[:5]}"


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_copies_match_ground_truth(stage: Stage, name: str, strategy: Strategy) -> None:
    staged = stage(SCENARIOS[name], seed=7)
    blocks = random_blocks(staged, 12, seed=len(name))
    job = TransferJob([staged.leg], *blocks)

    result = CopyEngine().copy(job, strategy=strategy)

    check_receiver(staged, blocks)
    plan = staged.leg.plan
    assert result.bytes == plan.bytes_per_block * 12
    assert result.fragments == plan.fragments_per_block * 12
    assert result.bytes > 0


def test_consecutive_blocks_copy_as_one_span(stage: Stage) -> None:
    staged = stage(SCENARIOS["nhd-head-slice"], seed=3)
    blocks = (np.array([3, 4, 5, 9, 10]), np.array([0, 1, 2, 7, 6]))

    # 3,4,5 -> 0,1,2 is one span; 9 -> 7 and 10 -> 6 break it on the receiver side.
    assert list(block_spans(*blocks)) == [(3, 0, 3), (9, 7, 1), (10, 6, 1)]
    CopyEngine(strategy=Strategy.BLOCKWISE).copy(TransferJob([staged.leg], *blocks))

    check_receiver(staged, blocks)


def test_compiled_program_is_reused_across_jobs(stage: Stage) -> None:
    staged = stage(SCENARIOS["pp-fan-in"], seed=5)
    engine = CopyEngine()
    first, second = random_blocks(staged, 4, seed=1), random_blocks(staged, 4, seed=2)
    engine.copy(TransferJob([staged.leg], *first))
    programs = len(engine._programs)
    engine.copy(TransferJob([staged.leg], *second))
    assert len(engine._programs) == programs == 2  # one per (sender rank, view)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "field", "message"),
    [
        ([0, 24], [0, 1], "src_blocks[1]", "block id 24 is outside sender rank 0 pool 0"),
        ([0, 1], [20, 1], "dst_blocks[0]", "block id 20 is outside receiver pool 0"),
        ([0, 1], [-1, 1], "dst_blocks[0]", "block id -1"),
        ([0, 1], [5, 5], "dst_blocks", "block id 5 appears more than once"),
    ],
)
def test_bad_block_ids_are_refused_before_copying(
    stage: Stage, src_blocks: list[int], dst_blocks: list[int], field: str, message: str
) -> None:
    staged = stage(SCENARIOS["hnd-head-slice"])
    job = TransferJob([staged.leg], src_blocks, dst_blocks)

    with pytest.raises(TransferValidationError, match=message) as raised:
        CopyEngine().copy(job)

    assert raised.value.field == field
    assert np.array_equal(staged.receiver.tensor.numpy(), staged.receiver_before)


def test_block_lists_must_pair_up(stage: Stage) -> None:
    staged = stage(SCENARIOS["hnd-head-slice"])
    with pytest.raises(TransferValidationError, match="has 1 ids but src_blocks has 2"):
        CopyEngine().validate(TransferJob([staged.leg], [0, 1], [0]))
    with pytest.raises(TransferValidationError, match="non-empty list of integer"):
        TransferJob([object()], [], [])  # type: ignore[list-item]


def test_fragment_beyond_slot_bytes_is_refused(stage: Stage) -> None:
    staged = stage(SCENARIOS["hnd-head-slice"])
    memory = staged.leg.src_pools[(0, 0)]
    # one byte short of the furthest byte rank 0's fragments read in a slot
    reach = max(copy.extent[0] for copy in staged.leg.plan.peers[0].copies)
    small = Pool(0, reach - 1, memory.pool.slot_stride, 24)
    shrunk = type(memory)(small, memory.backend, memory.tensor)
    leg = type(staged.leg)(staged.leg.plan, {(0, 0): shrunk}, staged.leg.dst_pools)

    with pytest.raises(TransferValidationError, match="beyond slot_bytes"):
        CopyEngine().validate(TransferJob([leg], [0], [0]))


def test_missing_sender_memory_is_named(stage: Stage) -> None:
    staged = stage(SCENARIOS["pp-fan-in"])
    leg = type(staged.leg)(
        staged.leg.plan, {(0, 0): staged.leg.src_pools[(0, 0)]}, staged.leg.dst_pools
    )
    with pytest.raises(TransferValidationError, match="sender rank 1 pool 0"):
        CopyEngine().validate(TransferJob([leg], [0], [0]))
