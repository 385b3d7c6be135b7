"""Fixtures: shared-memory segments owned by separate worker processes, and the transfer scenarios.

Each simulated worker (two context ranks and one generation rank) is a real process started with
multiprocessing "spawn" that creates its segments; the test process plays kvroute and only attaches.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvroute.geometry import Pool
from kvroute.transfer import CopyPlan, PoolMemory, PoolMemoryCache, ShmBackend, TransferLeg
from tests.transfer import shm_owner
from tests.transfer.layouts import HeadCopy, ViewLayout, plan_document, seeded_bytes

REPLY_TIMEOUT_S = 30.0


class Owners:
    """Talks to the owner processes; ``create`` returns the new segment's name."""

    def __init__(self, names: tuple[str, ...]) -> None:
        context = multiprocessing.get_context("spawn")
        self._queues = {}
        self._processes = []
        for name in names:
            commands, replies = context.Queue(), context.Queue()
            process = context.Process(target=shm_owner.serve, args=(commands, replies), daemon=True)
            process.start()
            self._queues[name] = (commands, replies)
            self._processes.append(process)

    def _call(self, owner: str, *command: object) -> tuple[object, ...]:
        commands, replies = self._queues[owner]
        commands.put(command)
        return replies.get(timeout=REPLY_TIMEOUT_S)

    def create(self, owner: str, size: int, seed: int) -> str:
        name = f"kvroute-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        assert self._call(owner, "create", name, size, seed) == ("created", name)
        return name

    def digest(self, owner: str, name: str) -> str:
        reply = self._call(owner, "digest", name)
        return str(reply[1])

    def truncate(self, owner: str, name: str, size: int) -> None:
        assert self._call(owner, "truncate", name, size) == ("truncated", name)

    def unlink(self, owner: str, name: str) -> None:
        assert self._call(owner, "unlink", name) == ("unlinked", name)

    def memfd(
        self, owner: str, size: int, seed: int, seals: tuple[str, ...] | None = ("F_SEAL_SHRINK",)
    ) -> dict[str, object]:
        """A memfd of the owner (sealable unless ``seals`` is None) as a pool's memory."""
        name = f"kvroute-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        reply = self._call(owner, "memfd", name, size, seed, seals)
        assert reply[0] == "memfd", reply
        return {"backend": "memfd", "pid": reply[1], "fd": reply[2]}

    def memfd_truncate(self, owner: str, fd: int, size: int) -> int | None:
        """The errno the owner's ftruncate failed with, or None when it shrank the memfd."""
        reply = self._call(owner, "memfd_truncate", fd, size)
        return int(reply[1]) if reply[0] == "refused" else None  # type: ignore[call-overload]

    def memfd_digest(self, owner: str, fd: int) -> str:
        return str(self._call(owner, "memfd_digest", fd)[1])

    def memfd_close(self, owner: str, fd: int) -> None:
        assert self._call(owner, "memfd_close", fd) == ("closed", fd)

    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process.pid is not None]

    def stop(self) -> None:
        for owner in self._queues:
            self._call(owner, "stop")
        for process in self._processes:
            process.join(timeout=REPLY_TIMEOUT_S)


@pytest.fixture(scope="session")
def owners() -> Iterator[Owners]:
    started = Owners(("ctx0", "ctx1", "gen0"))
    yield started
    started.stop()


@dataclass
class Scenario:
    """Senders (pool 0 of each rank) copy ``copies`` into receiver pool 0."""

    name: str
    src_slot_bytes: int
    dst_slot_bytes: int
    copies: dict[int, list[HeadCopy]]
    silent: tuple[int, ...] = ()
    offset: int = 0  # byte offset of slot 0 inside every segment
    src_slots: int = 24
    dst_slots: int = 20
    src_stride: int = field(init=False)
    dst_stride: int = field(init=False)

    def __post_init__(self) -> None:
        # strides above slot_bytes: the padding between slots must stay untouched too
        self.src_stride = self.src_slot_bytes + 64
        self.dst_stride = self.dst_slot_bytes + 32

    def plan(self) -> CopyPlan:
        peers = {rank: [(0, 0, copy) for copy in copies] for rank, copies in self.copies.items()}
        return CopyPlan.from_json(plan_document(self.name, peers, self.silent))

    @property
    def src_pool(self) -> Pool:
        return Pool(0, self.src_slot_bytes, self.src_stride, self.src_slots)

    @property
    def dst_pool(self) -> Pool:
        return Pool(0, self.dst_slot_bytes, self.dst_stride, self.dst_slots)

    def bytes_per_block(self) -> int:
        return self.plan().bytes_per_block


def _hnd_pair(kind: str) -> Scenario:
    src, dst = ViewLayout(kind, 4, 8), ViewLayout(kind, 4, 4)
    # generation TP2 rank 1 holds heads 4..7 of context TP1's 8
    return Scenario(f"{kind}-head-slice", src.end, dst.end, {0: [HeadCopy(src, dst, 4, 0, 4)]})


def _replicated() -> Scenario:
    latent = ViewLayout("hnd", 4, 1, buffers=1, head_bytes=64)
    return Scenario(
        "replicated",
        latent.end,
        latent.end,
        {0: [HeadCopy(latent, latent, 0, 0, 1)]},
        silent=(1,),
        offset=4096,
    )


def _target_and_draft() -> Scenario:
    src_target, dst_target = ViewLayout("hnd", 4, 4), ViewLayout("hnd", 4, 8)
    src_draft = ViewLayout("hnd", 1, 1, offset=src_target.end)
    dst_draft = ViewLayout("hnd", 1, 1, offset=dst_target.end)
    return Scenario(
        "target-and-draft",
        src_draft.end,
        dst_draft.end,
        {
            0: [HeadCopy(src_target, dst_target, 0, 0, 4), HeadCopy(src_draft, dst_draft, 0, 0, 1)],
            1: [HeadCopy(src_target, dst_target, 0, 4, 4)],  # its draft replica is not elected
        },
    )


def _pp_fan_in() -> Scenario:
    stage, whole = ViewLayout("nhd", 2, 8), ViewLayout("nhd", 4, 8)
    return Scenario(
        "pp-fan-in",
        stage.end,
        whole.end,
        {
            0: [HeadCopy(stage, whole, 0, 0, 8, dst_layer=0)],
            1: [HeadCopy(stage, whole, 0, 0, 8, dst_layer=2)],
        },
    )


SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        _hnd_pair("hnd"),
        _hnd_pair("nhd"),
        _replicated(),
        _target_and_draft(),
        _pp_fan_in(),
    )
}


@dataclass
class Staged:
    """A scenario's segments, opened as kvroute would, plus what the ground truth needs."""

    scenario: Scenario
    leg: TransferLeg
    senders: dict[int, np.ndarray]  # seeded contents, regenerated independently of the segments
    receiver_before: np.ndarray
    receiver: PoolMemory
    receiver_segment: str  # owned by the "gen0" process


@pytest.fixture
def stage(owners: Owners) -> Iterator[object]:
    created: list[tuple[str, str]] = []
    cache = PoolMemoryCache([ShmBackend()])

    def make(scenario: Scenario, seed: int = 0) -> Staged:
        plan = scenario.plan()
        src_pools, senders = {}, {}
        for rank in (*scenario.copies, *scenario.silent):
            size = scenario.offset + scenario.src_pool.size_bytes
            name = owners.create(f"ctx{rank}", size, seed + rank)
            created.append((f"ctx{rank}", name))
            descriptor = {"backend": "shm", "name": name, "offset": scenario.offset}
            src_pools[(rank, 0)] = cache.open_pool(descriptor, scenario.src_pool)
            senders[rank] = seeded_bytes(seed + rank, size)[scenario.offset :]
        size = scenario.offset + scenario.dst_pool.size_bytes
        name = owners.create("gen0", size, seed + 100)
        created.append(("gen0", name))
        descriptor = {"backend": "shm", "name": name, "offset": scenario.offset}
        receiver = cache.open_pool(descriptor, scenario.dst_pool)
        before = seeded_bytes(seed + 100, size)[scenario.offset :]
        leg = TransferLeg(plan, src_pools, {0: receiver})
        return Staged(scenario, leg, senders, before, receiver, name)

    yield make
    cache.close()
    for owner, name in created:
        owners.unlink(owner, name)
