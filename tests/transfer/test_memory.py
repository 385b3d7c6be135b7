"""Memory backends: opening, refusing, caching and releasing pool memory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from kvroute.geometry import Pool
from kvroute.transfer import (
    CudaIpcBackend,
    LocalBackend,
    PoolMemory,
    PoolMemoryCache,
    PoolMemoryError,
    ShmBackend,
    TransferJob,
    TransferLeg,
)
from tests.transfer.conftest import Owners
from tests.transfer.copies import copy_plan, pair
from tests.transfer.shm_owner import seeded_bytes

POOL = Pool(pool_id=3, slot_bytes=96, slot_stride=128, num_slots=8)  # 1024 bytes
# One view of pool 3 on both sides: a slot's first 16 bytes (two buffers of 8) move.
ONE_PLAN = copy_plan((0, [pair([[0, 0, 8], [8, 8, 8]], pool=3)]))


def test_shm_maps_exactly_the_pool_after_the_offset(owners: Owners) -> None:
    name = owners.create("ctx0", 64 + POOL.size_bytes + 100, seed=11)
    try:
        memory = ShmBackend().open({"backend": "shm", "name": name, "offset": 64}, POOL)
        assert memory.tensor.numel() == POOL.size_bytes
        expected = seeded_bytes(11, 64 + POOL.size_bytes)[64:]
        assert memory.tensor.numpy().tobytes() == expected.tobytes()
        memory.close()
        assert memory.closed
    finally:
        owners.unlink("ctx0", name)


def test_shm_writes_reach_the_owner_and_closing_never_unlinks(owners: Owners) -> None:
    name = owners.create("ctx1", POOL.size_bytes, seed=1)
    with PoolMemoryCache([ShmBackend()]) as cache:
        memory = cache.open_pool({"backend": "shm", "name": name}, POOL)
        memory.tensor.fill_(7)
    assert Path("/dev/shm", name).exists()
    assert owners.digest("ctx1", name) == hashlib.sha256(bytes([7]) * POOL.size_bytes).hexdigest()
    owners.unlink("ctx1", name)  # the owner still can: kvroute took no ownership


def test_missing_segment_is_a_pool_memory_error() -> None:
    with pytest.raises(
        PoolMemoryError, match="no shared memory segment named 'kvroute-absent'"
    ) as e:
        ShmBackend().open({"backend": "shm", "name": "kvroute-absent"}, POOL)
    assert (e.value.pool_id, e.value.backend) == (3, "shm")


@pytest.mark.parametrize("offset", [0, 200])
def test_segment_smaller_than_the_pool_is_refused(owners: Owners, offset: int) -> None:
    name = owners.create("ctx0", offset + POOL.size_bytes - 1, seed=2)
    try:
        with pytest.raises(PoolMemoryError, match=f"needs {offset + POOL.size_bytes}"):
            ShmBackend().open({"backend": "shm", "name": name, "offset": offset}, POOL)
    finally:
        owners.unlink("ctx0", name)


@pytest.mark.parametrize("name", ["", ".", "..", "../etc/passwd", "a/b", "x" * 201, "sp ace", 42])
def test_unsafe_segment_names_are_refused(name: object) -> None:
    with pytest.raises(PoolMemoryError, match="segment name"):
        ShmBackend().open({"backend": "shm", "name": name}, POOL)


def test_negative_offset_is_refused() -> None:
    backend = LocalBackend()
    backend.register("x", torch.zeros(POOL.size_bytes, dtype=torch.uint8))
    with pytest.raises(PoolMemoryError, match="offset must be an integer >= 0"):
        backend.open({"backend": "local", "name": "x", "offset": -1}, POOL)


def test_segment_in_use_is_not_unmapped(owners: Owners) -> None:
    name = owners.create("ctx0", POOL.size_bytes, seed=3)
    try:
        memory = ShmBackend().open({"backend": "shm", "name": name}, POOL)
        held = memory.tensor[:16]
        with pytest.raises(PoolMemoryError, match="still in use"):
            memory.close()
        assert held.sum().item() == int(seeded_bytes(3, 16).sum())
        del held
    finally:
        owners.unlink("ctx0", name)


def test_local_backend_reinterprets_any_contiguous_tensor() -> None:
    backend = LocalBackend()
    backend.register("kv", torch.arange(300, dtype=torch.int32))  # 1200 bytes
    memory = backend.open({"backend": "local", "name": "kv", "offset": 4}, POOL)
    assert memory.tensor.dtype == torch.uint8
    assert memory.tensor[:4].tolist() == [1, 0, 0, 0]
    with pytest.raises(PoolMemoryError, match="mapping is 1200 bytes but"):
        backend.open({"backend": "local", "name": "kv", "offset": 200}, POOL)
    backend.unregister("kv")
    with pytest.raises(PoolMemoryError, match="no local tensor named 'kv'"):
        backend.open({"backend": "local", "name": "kv"}, POOL)


def test_cache_opens_once_per_descriptor_and_geometry() -> None:
    backend = LocalBackend()
    backend.register("kv", torch.zeros(4096, dtype=torch.uint8))
    cache = PoolMemoryCache([backend])
    first = cache.open_pool({"backend": "local", "name": "kv"}, POOL)
    assert cache.open_pool({"name": "kv", "backend": "local"}, POOL) is first
    bigger = Pool(3, 96, 128, 16)
    assert cache.open_pool({"backend": "local", "name": "kv"}, bigger) is not first
    assert len(cache) == 2
    cache.close()
    assert first.closed
    assert len(cache) == 0
    with pytest.raises(PoolMemoryError, match="memory was closed"):
        _ = first.tensor


def test_cache_refuses_unknown_backends_and_missing_memory() -> None:
    cache = PoolMemoryCache([LocalBackend()])
    with pytest.raises(PoolMemoryError, match="unsupported memory backend") as e:
        cache.open_pool({"backend": "nixl"}, POOL)
    assert e.value.backend == "nixl"
    with pytest.raises(PoolMemoryError, match="registered without memory"):
        cache.open_pool(None, POOL)


def test_pool_memory_must_be_exactly_the_pool() -> None:
    with pytest.raises(PoolMemoryError, match="expected num_slots \\* slot_stride = 1024"):
        PoolMemory(POOL, "local", torch.zeros(1000, dtype=torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_ipc_is_refused_cleanly_without_cuda() -> None:
    with pytest.raises(PoolMemoryError, match="CUDA is not available") as e:
        CudaIpcBackend().open({"backend": "cuda_ipc", "handle": "AAAA", "device": 0}, POOL)
    assert e.value.backend == "cuda_ipc"


def _segment(root: Path, name: str, fill: int) -> None:
    (root / name).write_bytes(bytes([fill]) * POOL.size_bytes)


def test_a_recreated_segment_is_mapped_again_not_written_through_the_dead_mapping(
    tmp_path: Path,
) -> None:
    descriptor = {"backend": "shm", "name": "kvroute-restarted"}
    with PoolMemoryCache([ShmBackend(root=tmp_path)]) as cache:
        _segment(tmp_path, "kvroute-restarted", 1)
        first = cache.open_pool(descriptor, POOL)
        assert cache.open_pool(descriptor, POOL) is first
        (tmp_path / "kvroute-restarted").unlink()  # the worker restarts and creates it anew
        _segment(tmp_path, "kvroute-restarted", 2)
        second = cache.open_pool(descriptor, POOL)
        assert second is not first
        second.tensor[:4] = 7
        del first, second
    assert (tmp_path / "kvroute-restarted").read_bytes()[:5] == bytes([7, 7, 7, 7, 2])


def test_a_vanished_segment_is_refused_instead_of_reused(tmp_path: Path) -> None:
    descriptor = {"backend": "shm", "name": "kvroute-gone"}
    with PoolMemoryCache([ShmBackend(root=tmp_path)]) as cache:
        _segment(tmp_path, "kvroute-gone", 0)
        cache.open_pool(descriptor, POOL)
        (tmp_path / "kvroute-gone").unlink()
        with pytest.raises(PoolMemoryError, match="no shared memory segment"):
            cache.open_pool(descriptor, POOL)


def test_a_cached_segment_that_shrank_is_refused_not_reused(tmp_path: Path) -> None:
    """The issue's crash: a cached mapping of a truncated segment must never be handed out again."""
    descriptor = {"backend": "shm", "name": "kvroute-shrinks"}
    with PoolMemoryCache([ShmBackend(root=tmp_path)]) as cache:
        _segment(tmp_path, "kvroute-shrinks", 1)
        cache.open_pool(descriptor, POOL)
        os.truncate(tmp_path / "kvroute-shrinks", 0)  # same file, same name: only the size changed
        with pytest.raises(PoolMemoryError, match=r"'kvroute-shrinks': mapping is 0 bytes"):
            cache.open_pool(descriptor, POOL)
        os.truncate(tmp_path / "kvroute-shrinks", POOL.size_bytes)  # grown back: usable again
        assert cache.open_pool(descriptor, POOL).tensor.numel() == POOL.size_bytes


def test_a_job_rechecks_its_pools_and_names_the_side(tmp_path: Path) -> None:
    backend = ShmBackend(root=tmp_path)
    _segment(tmp_path, "kvroute-src", 1)
    _segment(tmp_path, "kvroute-dst", 2)
    src = backend.open({"backend": "shm", "name": "kvroute-src"}, POOL)
    dst = backend.open({"backend": "shm", "name": "kvroute-dst"}, POOL)
    job = TransferJob([TransferLeg(ONE_PLAN, {(0, 3): src}, {3: dst})], [0], [0])
    job.verify_memory()
    os.truncate(tmp_path / "kvroute-dst", 100)
    with pytest.raises(PoolMemoryError, match=r"receiver: segment 'kvroute-dst': mapping is 100"):
        job.verify_memory()


def test_a_segment_of_an_untrusted_owner_is_refused(tmp_path: Path) -> None:
    _segment(tmp_path, "kvroute-foreign", 0)
    stranger = os.geteuid() + 1
    with pytest.raises(PoolMemoryError, match=f"owned by uid {os.geteuid()}, not by a worker uid"):
        ShmBackend(root=tmp_path, owners={stranger}).open(
            {"backend": "shm", "name": "kvroute-foreign"}, POOL
        )
    # The default trusts the uid kvroute runs as.
    assert ShmBackend(root=tmp_path).open({"backend": "shm", "name": "kvroute-foreign"}, POOL)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's file needs root")
def test_a_file_of_another_user_is_refused_even_when_kvroute_could_open_it(tmp_path: Path) -> None:
    """The issue's case: kvroute as root wrote into a 0600 file owned by uid 65534."""
    _segment(tmp_path, "kvroute-nobody", 0)
    os.chown(tmp_path / "kvroute-nobody", 65534, 65534)
    os.chmod(tmp_path / "kvroute-nobody", 0o600)
    with pytest.raises(PoolMemoryError, match="owned by uid 65534"):
        ShmBackend(root=tmp_path).open({"backend": "shm", "name": "kvroute-nobody"}, POOL)


@pytest.mark.parametrize("name", ["PostgreSQL.1234", "other-kvroute-x"])
def test_a_segment_outside_the_name_prefix_is_refused(tmp_path: Path, name: str) -> None:
    _segment(tmp_path, name, 0)
    with pytest.raises(PoolMemoryError, match="does not start with 'kvroute-'"):
        ShmBackend(root=tmp_path).open({"backend": "shm", "name": name}, POOL)
    assert ShmBackend(root=tmp_path, name_prefix="").open({"backend": "shm", "name": name}, POOL)


def test_a_trailing_newline_is_not_a_segment_name(tmp_path: Path) -> None:
    with pytest.raises(PoolMemoryError, match="must match"):
        ShmBackend(root=tmp_path).open({"backend": "shm", "name": "kvroute-x\n"}, POOL)
