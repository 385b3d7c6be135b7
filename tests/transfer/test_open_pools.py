"""The pools a process keeps open: shared by jobs, closed once idle and their rank is gone, bounded.

Pools are real segment files (``ShmBackend`` over a temporary directory); what is open is read from
this process's own ``/proc/self/fd``, not from the cache's counters alone.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.geometry import Pool
from kvroute.transfer import PoolMemoryCache, PoolOwner, PoolsExhausted, ShmBackend

POOL = Pool(pool_id=0, slot_bytes=64, slot_stride=64, num_slots=4)
MAX_ROUNDS = 2_000  # bounds the loop that runs this process out of descriptors


def _segments(root: Path, count: int) -> list[dict[str, object]]:
    descriptors = []
    for index in range(count):
        (root / f"kvroute-p{index}").write_bytes(bytes(POOL.size_bytes))
        descriptors.append({"backend": "shm", "name": f"kvroute-p{index}"})
    return descriptors


def _open_files(root: Path) -> int:
    """Descriptors of this process that lead into ``root`` (ours and mmap's duplicates)."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        count += target.startswith(str(root))
    return count


def _mapped(root: Path) -> int:
    return sum(str(root) in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[PoolMemoryCache]:
    with PoolMemoryCache([ShmBackend(root=tmp_path)], max_open=3) as opened:
        yield opened


def test_a_deleted_ranks_idle_pools_are_closed_at_once(tmp_path: Path, cache) -> None:
    gone, kept = _segments(tmp_path, 2)
    owner = PoolOwner("d", "ctx0", 0, generation=1)
    first = cache.open_pool(gone, POOL, owner)
    cache.open_pool(kept, POOL, PoolOwner("d", "gen0", 0, generation=1))
    cache.release([first])
    assert (len(cache), cache.open_descriptors, _open_files(tmp_path), _mapped(tmp_path)) == (
        2, 4, 4, 2,
    )  # fmt: skip

    assert cache.retire("d", "ctx0", 0) == 1

    assert first.closed
    assert (len(cache), cache.open_descriptors, _open_files(tmp_path), _mapped(tmp_path)) == (
        1, 2, 2, 1,
    )  # fmt: skip


def test_a_pool_in_use_is_closed_when_its_last_job_ends(tmp_path: Path, cache) -> None:
    (descriptor,) = _segments(tmp_path, 1)
    owner = PoolOwner("d", "ctx0", 0, generation=1)
    memory = cache.open_pool(descriptor, POOL, owner)
    assert cache.open_pool(descriptor, POOL, owner) is memory  # a second job shares it
    cache.retire("d", "ctx0")  # the whole instance was deleted under two queued jobs
    cache.release([memory])
    assert not memory.closed
    memory.verify()  # the remaining job still copies through it
    cache.release([memory])
    assert memory.closed
    assert (len(cache), _open_files(tmp_path), _mapped(tmp_path)) == (0, 0, 0)


def test_a_re_registered_rank_leaves_its_old_pools_behind(tmp_path: Path, cache) -> None:
    old, new, same = _segments(tmp_path, 3)
    before = cache.open_pool(old, POOL, PoolOwner("d", "ctx0", 0, generation=1))
    shared = cache.open_pool(same, POOL, PoolOwner("d", "ctx0", 1, generation=4))
    cache.release([before, shared])

    # generation 2 of rank 0 registered other memory: the first job at it retires generation 1
    after = cache.open_pool(new, POOL, PoolOwner("d", "ctx0", 0, generation=2))
    # rank 1 re-registered the same memory: the mapping is kept, now at generation 5
    cache.supersede(PoolOwner("d", "ctx0", 1, generation=5))
    assert before.closed
    assert shared.closed  # superseded before any job at generation 5 opened it
    assert cache.owners() == {PoolOwner("d", "ctx0", 0, generation=2)}
    assert cache.open_pool(same, POOL, PoolOwner("d", "ctx0", 1, generation=5)) is not shared
    assert not after.closed


def test_at_most_max_open_pools_stay_open_least_recently_used_closing_first(
    tmp_path: Path, cache
) -> None:
    descriptors = _segments(tmp_path, 5)
    opened = [cache.open_pool(descriptor, POOL) for descriptor in descriptors[:3]]
    cache.release(opened)
    cache.open_pool(descriptors[0], POOL)  # used again: now the most recent

    fourth = cache.open_pool(descriptors[3], POOL)

    assert [memory.closed for memory in opened] == [False, True, False]
    assert len(cache) == 3
    assert _open_files(tmp_path) == 6
    # every open pool now in use by a job: one more is refused, to be retried, not a 500
    cache.open_pool(descriptors[2], POOL)
    with pytest.raises(PoolsExhausted, match="3 pools are open and in use by jobs") as refused:
        cache.open_pool(descriptors[4], POOL)
    assert refused.value.retry_after > 0
    cache.release([fourth])
    assert not cache.open_pool(descriptors[4], POOL).closed
    assert fourth.closed


def test_a_process_out_of_descriptors_refuses_pools_it_cannot_open_and_recovers(
    tmp_path: Path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = []
    with PoolMemoryCache([ShmBackend(root=tmp_path)], max_open=10_000) as cache:
        numbers = [int(entry) for entry in os.listdir("/proc/self/fd")]
        limit = max(numbers) + 8
        free = limit - len(numbers)  # descriptor numbers left below the limit, holes included
        assert free < 2 * MAX_ROUNDS
        descriptors = _segments(tmp_path, free // 2 + 2)  # more than the free numbers allow
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            with pytest.raises(PoolsExhausted, match="Too many open files"):  # noqa: PT012
                for descriptor in descriptors:
                    in_use.append(cache.open_pool(descriptor, POOL))
            assert 0 < len(in_use) < len(descriptors)
            # one job ends: its pool is idle, so opening another closes it and succeeds
            cache.release(in_use[:1])
            assert not cache.open_pool(descriptors[len(in_use)], POOL).closed
            assert in_use[0].closed
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
