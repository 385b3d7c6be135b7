"""Sealed memfd pools: a worker process's memfd, reached through its /proc/<pid>/fd entry.

The owner is a separate process (``shm_owner``), as in production; kvroute (this process) opens the
memfd only when it is sealed against shrinking, and re-checks on every use that the owner still
holds that very memfd.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from kvroute.client.memory import ShmPool
from kvroute.geometry import Pool
from kvroute.transfer import MemfdBackend, PoolMemoryCache, PoolMemoryError
from tests.transfer.conftest import Owners
from tests.transfer.shm_owner import seeded_bytes

POOL = Pool(pool_id=2, slot_bytes=96, slot_stride=128, num_slots=8)  # 1024 bytes


def test_a_sealed_memfd_of_another_process_is_mapped_and_written_through(owners: Owners) -> None:
    descriptor = owners.memfd("ctx0", 64 + POOL.size_bytes, seed=4) | {"offset": 64}
    fd = int(descriptor["fd"])  # type: ignore[call-overload]
    try:
        with PoolMemoryCache([MemfdBackend()]) as cache:
            memory = cache.open_pool(descriptor, POOL)
            expected = seeded_bytes(4, 64 + POOL.size_bytes)[64:]
            assert memory.tensor.numpy().tobytes() == expected.tobytes()
            memory.tensor.fill_(9)
            assert memory.descriptors == 2
        written = seeded_bytes(4, 64).tobytes() + bytes([9]) * POOL.size_bytes
        assert owners.memfd_digest("ctx0", fd) == hashlib.sha256(written).hexdigest()
    finally:
        owners.memfd_close("ctx0", fd)


def test_the_owner_cannot_shrink_a_sealed_memfd_kvroute_maps(owners: Owners) -> None:
    descriptor = owners.memfd("ctx1", POOL.size_bytes, seed=5)
    fd = int(descriptor["fd"])  # type: ignore[call-overload]
    try:
        memory = MemfdBackend().open(descriptor, POOL)
        assert owners.memfd_truncate("ctx1", fd, 0) == errno.EPERM
        memory.verify()  # still whole: nothing can fault a copy through it
        assert memory.tensor[-8:].tolist() == seeded_bytes(5, POOL.size_bytes)[-8:].tolist()
        memory.close()
    finally:
        owners.memfd_close("ctx1", fd)


@pytest.mark.parametrize(
    ("seals", "reason"),
    [
        (None, "not sealed against shrinking"),  # created without MFD_ALLOW_SEALING
        ((), "not sealed against shrinking"),  # sealable, but never sealed
        (("F_SEAL_GROW",), "not sealed against shrinking"),
        (("F_SEAL_SHRINK", "F_SEAL_WRITE"), "sealed against writes"),
    ],
)
def test_a_memfd_that_could_shrink_or_refuses_writes_is_refused(
    owners: Owners, seals: tuple[str, ...] | None, reason: str
) -> None:
    descriptor = owners.memfd("gen0", POOL.size_bytes, seed=6, seals=seals)
    try:
        with pytest.raises(PoolMemoryError, match=reason) as refused:
            MemfdBackend().open(descriptor, POOL)
        assert (refused.value.pool_id, refused.value.backend) == (2, "memfd")
        assert f"pid {descriptor['pid']} fd {descriptor['fd']}" in refused.value.reason
    finally:
        owners.memfd_close("gen0", int(descriptor["fd"]))  # type: ignore[call-overload]


def test_a_memfd_the_owner_closed_fails_the_next_use(owners: Owners) -> None:
    descriptor = owners.memfd("ctx0", POOL.size_bytes, seed=7)
    memory = MemfdBackend().open(descriptor, POOL)
    owners.memfd_close("ctx0", int(descriptor["fd"]))  # type: ignore[call-overload]
    with pytest.raises(PoolMemoryError, match="closed or replaced by its owner"):
        memory.verify()
    with pytest.raises(PoolMemoryError, match="no process holds a descriptor"):
        MemfdBackend().open(descriptor, POOL)
    memory.close()


def test_a_descriptor_that_is_not_a_memfd_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvroute-file"
    path.write_bytes(bytes(POOL.size_bytes))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(PoolMemoryError, match="is not a memfd"):
            MemfdBackend().open({"backend": "memfd", "pid": os.getpid(), "fd": fd}, POOL)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pid": 0}, "pid must be an integer >= 1"),
        ({"pid": True}, "pid must be an integer >= 1"),
        ({"fd": -1}, "fd must be an integer >= 0"),
        ({"fd": "3"}, "fd must be an integer >= 0"),
        ({"offset": -4}, "offset must be an integer >= 0"),
    ],
)
def test_malformed_memfd_descriptors_are_refused(change: dict[str, object], reason: str) -> None:
    descriptor = {"backend": "memfd", "pid": os.getpid(), "fd": 0} | change
    with pytest.raises(PoolMemoryError, match=reason):
        MemfdBackend().open(descriptor, POOL)


def test_memfds_outside_the_prefix_and_of_untrusted_owners_are_refused() -> None:
    with ShmPool("kvroute-prefix-test", POOL.size_bytes) as pool:
        descriptor = pool.descriptor()
        with pytest.raises(PoolMemoryError, match="does not start with 'other-'"):
            MemfdBackend(name_prefix="other-").open(descriptor, POOL)
        with pytest.raises(PoolMemoryError, match="not by a worker uid this kvroute trusts"):
            MemfdBackend(owners=[os.geteuid() + 1]).open(descriptor, POOL)
        with pytest.raises(PoolMemoryError, match="mapping is 1024 bytes but"):
            MemfdBackend().open(descriptor, Pool(2, 96, 128, 9))


def test_the_client_pool_helper_makes_a_sealed_memfd_by_default() -> None:
    with ShmPool("kvroute-client-sealed", POOL.size_bytes) as pool:
        descriptor = pool.descriptor(offset=0)
        assert descriptor == {"backend": "memfd", "pid": os.getpid(), "fd": descriptor["fd"],
                              "offset": 0}  # fmt: skip
        assert not Path("/dev/shm/kvroute-client-sealed").exists()  # nothing named to unlink
        with pytest.raises(PermissionError, match="Operation not permitted"):
            os.ftruncate(int(descriptor["fd"]), 0)
        memory = MemfdBackend().open(descriptor, POOL)
        pool.tensor[:3] = 5
        assert memory.tensor[:4].tolist() == [5, 5, 5, 0]
        memory.close()
    with ShmPool("kvroute-client-plain", POOL.size_bytes, sealed=False) as plain:
        assert plain.descriptor() == {"backend": "shm", "name": "kvroute-client-plain",
                                      "offset": 0}  # fmt: skip
        assert Path("/dev/shm/kvroute-client-plain").exists()
    assert not Path("/dev/shm/kvroute-client-plain").exists()
