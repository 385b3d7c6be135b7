"""Fixtures: shared-memory segments owned by separate worker processes, and the transfer scenarios
(worlds of the shared ground truth, ``tests/transfer/pools.py``).

Each simulated worker (two context ranks and one generation rank) is a real process started with
multiprocessing "spawn" that creates its segments; the test process plays kvroute and only attaches.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvroute.transfer import PoolMemory, PoolMemoryCache, ShmBackend, TransferLeg
from tests.transfer import shm_owner
from tests.transfer.pools import Scenario
from tests.transfer.shm_owner import seeded_bytes
from tests.world import Side, ViewClass

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

    def create(self, owner: str, size: int, seed: int, content: bytes | None = None) -> str:
        """A segment of ``size`` seeded bytes (``content`` instead, where given)."""
        name = f"kvroute-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        assert self._call(owner, "create", name, size, seed, content) == ("created", name)
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


def _kv(kind: str, heads: int, owner: str = "target") -> ViewClass:
    return ViewClass(("key", "value"), owner, kind, total_heads=heads, buffers=2, unit=16)


def _sides(
    ctx_tp: int, gen_tp: int, ctx_stages: tuple[int, ...] = (4,), draft: int = 0
) -> tuple[Side, Side]:
    """4 layers, 8 tokens per block; 24 sender and 20 receiver slots."""
    ctx = Side("context", ctx_tp, ctx_stages, tokens_per_block=8, num_slots=24, seed=1,
               num_draft_layers=draft)  # fmt: skip
    gen = Side("generation", gen_tp, (4,), tokens_per_block=8, num_slots=20, seed=2,
               num_draft_layers=draft)  # fmt: skip
    return ctx, gen


LATENT = ViewClass(("latent",), "target", "replicated", total_heads=1, buffers=1, unit=64)
SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        # generation TP2 rank 1 holds heads 4..7 of context TP1's 8
        Scenario("hnd-head-slice", [_kv("hnd", 8)], *_sides(1, 2), receiver=1),
        Scenario("nhd-head-slice", [_kv("nhd", 8)], *_sides(1, 2), receiver=1),
        # one of the two context replicas sends; the segments start 4096 bytes in
        Scenario("replicated", [LATENT], *_sides(2, 1), offset=4096),
        # the draft's one head is on both context ranks: one replica is elected
        Scenario(
            "target-and-draft", [_kv("hnd", 8), _kv("hnd", 1, "draft")], *_sides(2, 1, draft=1)
        ),
        Scenario("pp-fan-in", [_kv("nhd", 8)], *_sides(1, 1, ctx_stages=(2, 2))),
    )
}


@dataclass
class Staged:
    """A scenario's segments, opened as kvroute would, plus the receiver's contents before."""

    scenario: Scenario
    leg: TransferLeg
    receiver_before: np.ndarray
    receiver: PoolMemory
    receiver_segment: str  # owned by the "gen0" process


@pytest.fixture
def stage(owners: Owners) -> Iterator[object]:
    created: list[tuple[str, str]] = []
    cache = PoolMemoryCache([ShmBackend()])

    def make(scenario: Scenario, seed: int = 0) -> Staged:
        """Sender segments holding the truth's bytes over seeded filler, a seeded receiver."""
        plan, offset = scenario.plan(), scenario.offset
        src_pools = {}
        for rank in scenario.sender_ranks:
            pool = scenario.src_pool(rank)
            content = seeded_bytes(seed + rank, offset + pool.size_bytes)
            content[offset:] = scenario.sender_bytes(rank, content[offset:])
            name = owners.create(f"ctx{rank}", len(content), seed + rank, content.tobytes())
            created.append((f"ctx{rank}", name))
            descriptor = {"backend": "shm", "name": name, "offset": offset}
            src_pools[(rank, pool.pool_id)] = cache.open_pool(descriptor, pool)
        size = offset + scenario.dst_pool.size_bytes
        name = owners.create("gen0", size, seed + 100)
        created.append(("gen0", name))
        descriptor = {"backend": "shm", "name": name, "offset": offset}
        receiver = cache.open_pool(descriptor, scenario.dst_pool)
        before = seeded_bytes(seed + 100, size)[offset:]
        leg = TransferLeg(plan, src_pools, {scenario.dst_pool.pool_id: receiver})
        return Staged(scenario, leg, before, receiver, name)

    yield make
    cache.close()
    for owner, name in created:
        owners.unlink(owner, name)
