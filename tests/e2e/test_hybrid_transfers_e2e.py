"""Hybrid transfers end to end: Mamba state and windowed attention moved over HTTP between shm pools.

A Nemotron-H-like hybrid (``tests/hybrid.py``: Mamba2 SSM and conv state, full and sliding-window
attention) is registered over HTTP by a context TP4 instance whose state shares its KV pool's slots
and a generation TP2 x PP2 instance with a separate state pool; segments are owned by separate
processes. One job moves one request: its last blocks (the windowed layer only those in its window)
and its state slot. Every byte of every receiver segment is checked against tests/truth.py: the
written ones hold their logical ids, all others are untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvroute.api import create_app
from kvroute.settings import Settings
from tests.e2e.test_transfers_e2e import (
    ADMIN_TOKEN,
    WORKER,
    Deployed,
    deploy,
    finished,
    hashed,
    owners,
    register,
    segment,
    segments,
)
from tests.hybrid import HYBRID
from tests.transfer.conftest import Owners
from tests.transfer.shm_owner import seeded_bytes
from tests.truth import Truth, window_starts
from tests.world import Side

__all__ = ["owners", "segments"]  # the module-scoped fixtures, shared with the plain e2e test

CTX = Side("context", 4, (6,), tokens_per_block=4, shared_state_pool=True, seed=11)
GEN = Side("generation", 2, (3, 3), tokens_per_block=4, seed=12)
SLOTS = 6
SRC_BLOCKS, SRC_STATE = [0, 2, 4], 5  # the sender's state shares the KV pool: slot 5 is state
DST_BLOCKS, DST_STATE = [3, 0, 1], 1  # the receiver's state pool is its own: slot 1 is free there
PROMPT = 12  # 3 blocks of 4 tokens; the 6-token window starts in block floor((12 + 1 - 6) / 4) = 1
REQUEST = 7


def _placement(blocks: list[int]) -> dict[int, int]:
    """List entry ``i`` holds the prompt's block ``i`` (the lists are the whole prompt)."""
    return {block: i * CTX.tokens_per_block for i, block in enumerate(blocks)}


def _write_sender(ctx: Deployed, truth: Truth) -> None:
    for rank, layout in enumerate(ctx.layouts):
        ids = truth.place(
            ctx.side, layout, rank, _placement(SRC_BLOCKS), states={SRC_STATE: REQUEST}
        )
        for pool, values in ids.items():
            mapped = segment(ctx.segments[rank, pool])
            mask = values != 0
            mapped[mask] = hashed(values[mask])
            mapped.flush()


def _expected(
    gen: Deployed, truth: Truth, rank: int, positions: range | None = None
) -> tuple[dict[int, np.ndarray], int]:
    """Each receiver pool's bytes after the job (of ``positions``, every one when None), and how
    many the job wrote."""
    starts = window_starts(CTX, GEN, HYBRID, PROMPT)
    ids = truth.place(gen.side, gen.layouts[rank], rank, _placement(DST_BLOCKS), positions,
                      starts=starts, states={DST_STATE: REQUEST})  # fmt: skip
    expected = {}
    for pool, values in ids.items():
        _, stride, slots = gen.layouts[rank].pools[pool]
        expected[pool] = seeded_bytes(gen.seeds[rank, pool], stride * slots)
        mask = values != 0
        expected[pool][mask] = hashed(values[mask])
    return expected, sum(int((values != 0).sum()) for values in ids.values())


async def _deployed(aiohttp_client, database_url, owners, segments):
    truth = Truth(HYBRID)
    ctx = deploy(owners, segments, "ctx", CTX, HYBRID, SLOTS, seed=300)
    gen = deploy(owners, segments, "gen", GEN, HYBRID, SLOTS, seed=400)
    _write_sender(ctx, truth)
    settings = Settings(
        database_url=database_url,
        worker_token=WORKER["Authorization"].removeprefix("Bearer "),
        admin_token=ADMIN_TOKEN,
    )
    client = await aiohttp_client(create_app(settings))
    await register(client, "hybrid", "ctx0", ctx)
    await register(client, "hybrid", "gen0", gen)
    return client, truth, gen


def _request(**changes: Any) -> dict[str, Any]:
    body = {
        "sender": "ctx0", "receiver": "gen0", "receiver_ranks": [0, 1, 2, 3],
        "src_blocks": SRC_BLOCKS, "dst_blocks": DST_BLOCKS, "src_state_slot": SRC_STATE,
        "dst_state_slot": DST_STATE, "prompt_tokens": PROMPT,
    }  # fmt: skip
    return {key: value for key, value in (body | changes).items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "positions"),
    [
        ({}, None),  # issue 12's job: the prompt's blocks, paired, and its length
        # A range after a 2-token cached prefix; the window is measured from its end (= PROMPT).
        ({"tokens": {"start": 2, "end": PROMPT}, "prompt_tokens": None}, range(2, PROMPT)),
    ],
)
async def test_a_request_moves_its_window_and_state_and_nothing_else(
    changes: dict[str, Any],
    positions: range | None,
    aiohttp_client: Any,
    database_url: str,
    owners: Owners,
    segments: list[tuple[str, str]],
) -> None:
    client, truth, gen = await _deployed(aiohttp_client, database_url, owners, segments)
    response = await client.post(
        "/v1/deployments/hybrid/transfers", json=_request(**changes), headers=WORKER
    )
    assert response.status == 202, await response.text()
    job = await finished(client, (await response.json())["id"])
    assert job["state"] == "succeeded", job["error"]
    members = ("tokens", "src_state_slot", "dst_state_slot", "prompt_tokens")
    given = _request(**changes)
    assert {name: job[name] for name in members if name in job} == {
        name: given[name] for name in members if name in given
    }
    written = 0
    for rank in range(4):
        expected, count = _expected(gen, truth, rank, positions)
        written += count
        for pool, want in expected.items():
            got = np.array(segment(gen.segments[rank, pool]))
            np.testing.assert_array_equal(got, want, err_msg=f"gen rank {rank} pool {pool}")
    assert job["bytes"] == written


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"src_state_slot": None}, "src_state_slot"),
        ({"dst_state_slot": None}, "dst_state_slot"),
        ({"prompt_tokens": None}, "prompt_tokens"),
        ({"dst_state_slot": SLOTS}, "dst_state_slot"),
        ({"src_state_slot": 0}, "src_state_slot"),  # the sender's slot 0 is a block of this job
    ],
)
async def test_requests_that_cannot_move_state_exactly_are_422(
    changes, field, aiohttp_client: Any, database_url: str, owners: Owners, segments
) -> None:
    client, _, _ = await _deployed(aiohttp_client, database_url, owners, segments)
    response = await client.post(
        "/v1/deployments/hybrid/transfers", json=_request(**changes), headers=WORKER
    )
    problem = await response.json()
    assert (response.status, problem["code"], problem["field"]) == (422, "invalid_transfer", field)


async def test_a_range_past_the_prompt_length_is_422_naming_both(
    aiohttp_client: Any, database_url: str, owners: Owners, segments
) -> None:
    client, _, _ = await _deployed(aiohttp_client, database_url, owners, segments)
    body = _request(tokens={"start": 0, "end": PROMPT}, prompt_tokens=PROMPT - 2)
    response = await client.post("/v1/deployments/hybrid/transfers", json=body, headers=WORKER)
    problem = await response.json()
    assert (response.status, problem["code"], problem["field"]) == (
        422,
        "prompt_tokens_contradicts_tokens",
        "prompt_tokens",
    )
    assert (problem["prompt_tokens"], problem["tokens"]) == (PROMPT - 2, [0, PROMPT])
    assert "ends before tokens.end 12" in problem["detail"]
