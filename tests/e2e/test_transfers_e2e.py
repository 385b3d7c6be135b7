"""Transfers end to end: ranks registered over HTTP with shared-memory pools, jobs run over HTTP.

Every rank's pools are POSIX shared-memory segments created by separate worker processes (spawned
owners, as real context and generation ranks would be); this process plays the workers writing
their KV cache into the sender segments and kvroute (the real app factory) copying between them.
The expected receiver bytes come from ``tests/world.py``, which shards one logical KV tensor by
first principles, never by the planner: every destination byte must hold the hashed id of its
logical element, and every other byte of every receiver segment must be untouched.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from kvroute.api import create_app
from kvroute.settings import Settings
from tests.transfer.conftest import Owners
from tests.transfer.shm_owner import seeded_bytes
from tests.truth import Truth
from tests.world import Layout, Side, ViewClass, layout_rank

WORKER = {"Authorization": "Bearer e2e-worker-token-0123456789"}
ADMIN_TOKEN = "e2e-admin-token-0123456789abcd"
SENDER_SLOTS = 6  # Truth ids hold logical blocks 0..7
RECEIVER_SLOTS = 5
POLLS = 400  # x 10 ms


@pytest.fixture(scope="module")
def owners() -> Iterator[Owners]:
    started = Owners(("ctx", "gen"))
    yield started
    started.stop()


@pytest.fixture
def segments(owners: Owners) -> Iterator[list[tuple[str, str]]]:
    """(owner, segment) pairs a test created; unlinked by their owners afterwards."""
    created: list[tuple[str, str]] = []
    yield created
    for owner, name in created:
        owners.unlink(owner, name)


def hashed(ids: np.ndarray) -> np.ndarray:
    """One byte per logical element id: a multiplicative hash, so a misplaced byte shows."""
    return ((ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(56)).astype(
        np.uint8
    )


def segment(name: str) -> np.memmap:
    """The segment as a worker sees it, mapped without kvroute's code."""
    return np.memmap(Path("/dev/shm") / name, dtype=np.uint8, mode="r+")


@dataclass
class Deployed:
    """One instance: its layouts and, per (rank, pool), the segment and its seeded bytes."""

    side: Side
    layouts: list[Layout]
    segments: dict[tuple[int, int], str]
    seeds: dict[tuple[int, int], int]


def deploy(
    owners: Owners,
    created: list[tuple[str, str]],
    owner: str,
    side: Side,
    classes: list[ViewClass],
    slots: int,
    seed: int,
) -> Deployed:
    ranks = side.tp_size * side.pp_size
    layouts = [layout_rank(side, classes, rank, num_slots=slots) for rank in range(ranks)]
    deployed = Deployed(side, layouts, {}, {})
    for rank, layout in enumerate(layouts):
        for pool in layout.doc["pools"]:
            key = (rank, pool["pool_id"])
            deployed.seeds[key] = seed + 10 * rank + pool["pool_id"]
            size = pool["slot_stride"] * pool["num_slots"]
            deployed.segments[key] = owners.create(owner, size, deployed.seeds[key])
            created.append((owner, deployed.segments[key]))
            pool["memory"] = {"backend": "shm", "name": deployed.segments[key]}
    return deployed


def write_kv(deployed: Deployed, truth: Truth) -> None:
    """Each sender rank holds logical block ``s`` in slot ``s``."""
    for rank, layout in enumerate(deployed.layouts):
        blocks = list(range(SENDER_SLOTS))
        for pool, ids in truth.fill(deployed.side, layout, rank, blocks, blocks).items():
            mapped = segment(deployed.segments[rank, pool])
            mask = ids != 0
            mapped[mask] = hashed(ids[mask])
            mapped.flush()


def expected_receiver(
    deployed: Deployed, truth: Truth, rank: int, pool: int, src: list[int], dst: list[int]
) -> np.ndarray:
    layout = deployed.layouts[rank]
    _, stride, slots = layout.pools[pool]
    expected = seeded_bytes(deployed.seeds[rank, pool], stride * slots)
    ids = truth.fill(deployed.side, layout, rank, dst, src)[pool]
    mask = ids != 0
    expected[mask] = hashed(ids[mask])
    return expected


async def register(client: TestClient, deployment: str, name: str, deployed: Deployed) -> None:
    for rank, layout in enumerate(deployed.layouts):
        path = f"/v1/deployments/{deployment}/instances/{name}/ranks/{rank}"
        response = await client.put(path, json=layout.doc, headers=WORKER)
        assert response.status == 201, await response.text()


async def finished(client: TestClient, job_id: str) -> dict[str, Any]:
    for _ in range(POLLS):
        response = await client.get(f"/v1/transfers/{job_id}", headers=WORKER)
        job = await response.json()
        if job["state"] not in ("queued", "running"):
            return dict(job)
        await asyncio.sleep(0.01)
    raise AssertionError(f"transfer {job_id} did not finish")


KV = ViewClass(("key", "value"), "target", "hnd", 4, 2, 4)
KV_NHD = ViewClass(("key", "value"), "target", "nhd", 4, 2, 2)
LATENT = ViewClass(("index_key",), "target", "replicated", 1, 1, 3)
DRAFT = ViewClass(("key", "value"), "draft", "hnd", 1, 2, 2)

# name -> (view classes, context side, generation side)
CASES: dict[str, tuple[list[ViewClass], Side, Side]] = {
    "hnd-tp2-to-tp1": (
        [KV],
        Side("context", 2, (2,), seed=1),
        Side("generation", 1, (2,), seed=2),
    ),
    "nhd-tp2-to-tp4-head-split": (
        [KV_NHD],
        Side("context", 2, (2,), seed=3),
        Side("generation", 4, (2,), seed=4),
    ),
    "replicated-view-beside-kv": (
        [KV, LATENT],
        Side("context", 2, (2,), seed=5),
        Side("generation", 4, (2,), seed=6),
    ),
    "target-and-draft-views": (
        [KV, DRAFT],
        Side("context", 2, (2,), num_draft_layers=1, seed=7),
        Side("generation", 1, (2,), num_draft_layers=1, seed=8),
    ),
    "pp-fan-in": (
        [KV],
        Side("context", 1, (1, 2), seed=9, shared_pool=False),
        Side("generation", 2, (3,), seed=10),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_job_copies_exactly_the_logical_blocks_and_nothing_else(
    case: str,
    aiohttp_client: Any,
    database_url: str,
    owners: Owners,
    segments: list[tuple[str, str]],
) -> None:
    classes, ctx_side, gen_side = CASES[case]
    truth = Truth(classes)
    ctx = deploy(owners, segments, "ctx", ctx_side, classes, SENDER_SLOTS, seed=100)
    gen = deploy(owners, segments, "gen", gen_side, classes, RECEIVER_SLOTS, seed=200)
    write_kv(ctx, truth)
    settings = Settings(
        database_url=database_url,
        worker_token=WORKER["Authorization"].removeprefix("Bearer "),
        admin_token=ADMIN_TOKEN,
    )
    client = await aiohttp_client(create_app(settings))
    await register(client, case, "ctx0", ctx)
    await register(client, case, "gen0", gen)
    rng = random.Random(case)
    src = rng.sample(range(SENDER_SLOTS), 4)
    dst = rng.sample(range(RECEIVER_SLOTS), 4)
    receiver_ranks = list(range(len(gen.layouts)))

    response = await client.post(
        f"/v1/deployments/{case}/transfers",
        json={
            "sender": "ctx0",
            "receiver": "gen0",
            "receiver_ranks": receiver_ranks,
            "src_blocks": src,
            "dst_blocks": dst,
        },
        headers=WORKER,
    )

    assert response.status == 202, await response.text()
    accepted = await response.json()
    assert response.headers["Location"] == f"/v1/transfers/{accepted['id']}"
    job = await finished(client, accepted["id"])
    assert job["state"] == "succeeded", job["error"]
    assert job["duration_seconds"] >= 0
    written = 0
    for rank in receiver_ranks:
        for pool in gen.layouts[rank].pools:
            want = expected_receiver(gen, truth, rank, pool, src, dst)
            got = np.array(segment(gen.segments[rank, pool]))
            np.testing.assert_array_equal(got, want, err_msg=f"{case}: gen rank {rank} pool {pool}")
            written += int(
                (truth.fill(gen.side, gen.layouts[rank], rank, dst, src)[pool] != 0).sum()
            )
    assert job["bytes"] == written


# name -> (view classes, context side, generation side): the generation side cuts blocks larger
SUFFIX_CASES: dict[str, tuple[list[ViewClass], Side, Side]] = {
    "hnd-4-to-8-tokens-tp2-to-tp1": (
        [KV, LATENT],
        Side("context", 2, (2,), tokens_per_block=4, seed=11),
        Side("generation", 1, (2,), tokens_per_block=8, seed=12),
    ),
    "nhd-4-to-6-tokens-heads-split": (
        [KV_NHD],
        Side("context", 2, (2,), tokens_per_block=4, seed=13),
        Side("generation", 4, (2,), tokens_per_block=6, seed=14),
    ),
}
PROMPT = (0, 21)  # the request's tokens; the receiver already holds the first CACHED of them
CACHED = 5


@pytest.mark.parametrize("case", list(SUFFIX_CASES))
async def test_a_mid_block_suffix_moves_between_block_sizes_and_nothing_else(
    case: str,
    aiohttp_client: Any,
    database_url: str,
    owners: Owners,
    segments: list[tuple[str, str]],
) -> None:
    classes, ctx_side, gen_side = SUFFIX_CASES[case]
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    truth = Truth(classes)
    ctx = deploy(owners, segments, "ctx", ctx_side, classes, SENDER_SLOTS, seed=300)
    gen = deploy(owners, segments, "gen", gen_side, classes, RECEIVER_SLOTS, seed=400)
    rng = random.Random(case)
    # The sender's list holds the whole prompt from token 0 in shuffled slots; the receiver's list
    # is the suffix from the block holding its first missing token (upstream's rule derives it).
    src = rng.sample(range(SENDER_SLOTS), -(-PROMPT[1] // ts))
    dst = rng.sample(range(RECEIVER_SLOTS), -(-PROMPT[1] // td) - CACHED // td)
    for rank, layout in enumerate(ctx.layouts):
        placement = {slot: i * ts for i, slot in enumerate(src)}
        for pool, ids in truth.place(ctx.side, layout, rank, placement).items():
            mapped = segment(ctx.segments[rank, pool])
            mask = ids != 0
            mapped[mask] = hashed(ids[mask])
            mapped.flush()
    settings = Settings(
        database_url=database_url,
        worker_token=WORKER["Authorization"].removeprefix("Bearer "),
        admin_token=ADMIN_TOKEN,
    )
    client = await aiohttp_client(create_app(settings))
    await register(client, case, "ctx0", ctx)
    await register(client, case, "gen0", gen)
    receiver_ranks = list(range(len(gen.layouts)))

    response = await client.post(
        f"/v1/deployments/{case}/transfers",
        json={
            "sender": "ctx0",
            "receiver": "gen0",
            "receiver_ranks": receiver_ranks,
            "src_blocks": src,
            "dst_blocks": dst,
            "tokens": {"start": CACHED, "end": PROMPT[1]},
            "src_first_token": 0,
        },
        headers=WORKER,
    )

    assert response.status == 202, await response.text()
    job = await finished(client, (await response.json())["id"])
    assert job["state"] == "succeeded", job["error"]
    assert job["bytes"] == check_suffix(case, gen, truth, dst)


def check_suffix(case: str, gen: Deployed, truth: Truth, dst: list[int]) -> int:
    """Every receiver byte: the moved tokens hold their ids, the rest its seeded bytes; returns
    the bytes the tokens take."""
    written, td = 0, gen.side.tokens_per_block
    for rank, layout in enumerate(gen.layouts):
        placement = {slot: (CACHED // td + i) * td for i, slot in enumerate(dst)}
        ids = truth.place(gen.side, layout, rank, placement, range(CACHED, PROMPT[1]))
        for pool, (_, stride, slots) in layout.pools.items():
            want = seeded_bytes(gen.seeds[rank, pool], stride * slots)
            mask = ids[pool] != 0
            want[mask] = hashed(ids[pool][mask])
            got = np.array(segment(gen.segments[rank, pool]))
            np.testing.assert_array_equal(got, want, err_msg=f"{case}: gen rank {rank} pool {pool}")
            written += int(mask.sum())
    return written
