"""Transfer jobs that name a token range: block lists of different block sizes on the two sides,
checked to cover the range (the copies themselves are tests/transfer's and tests/e2e's subject)."""

from __future__ import annotations

import pytest

from kvroute.api.keys import sessionmaker_key
from kvroute.store import jobs
from tests.api.conftest import WORKER
from tests.api.transfers.world import (
    BYTES_PER_TOKEN,
    GENERATION,
    TRANSFERS,
    WIDE,
    body,
    register_world,
    until,
)
from tests.world import Side


async def test_a_token_range_moves_between_block_sizes(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    # tokens [5, 14): the sender's suffix list starts at token 4 (blocks 1..3 of 4 tokens),
    # the receiver's at token 0 (blocks of 8); both are derived by upstream's rule
    request = body([3, 1, 2], [2, 0]) | {"tokens": {"start": 5, "end": 14}}

    response = await client.post(TRANSFERS, json=request, headers=WORKER)

    assert response.status == 202, await response.text()
    job = await until(client, (await response.json())["id"], {"succeeded", "failed"})
    assert job["state"] == "succeeded", job["error"]
    assert job["bytes"] == 9 * BYTES_PER_TOKEN
    assert job["tokens"] == {"start": 5, "end": 14}  # the answer says what the job moved
    assert "src_first_token" not in job  # members the request did not give are absent


async def test_a_job_answers_with_the_token_members_it_was_given(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    members = {"tokens": {"start": 6, "end": 12}, "src_first_token": 4, "dst_first_token": 0}
    response = await client.post(TRANSFERS, json=body([1, 2], [0, 1]) | members, headers=WORKER)
    assert response.status == 202, await response.text()
    submitted = await response.json()

    job = await until(client, submitted["id"], {"succeeded", "failed"})

    assert job["state"] == "succeeded", job["error"]
    for answer in (submitted, job):
        assert {name: answer.get(name) for name in members} == members
        assert "src_state_slot" not in answer
        assert "prompt_tokens" not in answer


# Receivers of 8 and of 2 tokens per block beside the sender's 4.
NARROW = Side("generation", 1, (2,), seed=2, tokens_per_block=2)


@pytest.mark.parametrize(
    ("generation", "src", "dst", "prompt", "moved"),
    [
        # the sender's suffix list holds [4, 16), the receiver's [0, 16): tokens [4, 14) move
        (WIDE, [1, 2, 3], [2, 0], 14, (4, 14)),
        # mirrored: the sender's list holds [0, 8), the receiver's (blocks of 2) [2, 8)
        (NARROW, [0, 1], [1, 2, 3], 7, (2, 7)),
        # equal sizes (issue 35): the lists hold [0, 8) and [4, 8); tokens [4, 7) move, not 7
        (GENERATION, [0, 1], [2], 7, (4, 7)),
        (GENERATION, [0, 1], [2, 1], 6, (0, 6)),
    ],
)
async def test_prompt_only_jobs_between_block_sizes_move_the_tokens_both_lists_hold(
    start, segment, generation, src, dst, prompt, moved
) -> None:
    """Issue 20: the range started at the earlier list's first token, which the other list cannot
    hold, and the job was refused with its own range; it also ran on past the prompt's end."""
    client = await start()
    await register_world(client, segment, generation=generation)
    request = body(src, dst) | {"prompt_tokens": prompt}

    response = await client.post(TRANSFERS, json=request, headers=WORKER)

    assert response.status == 202, await response.text()
    job = await until(client, (await response.json())["id"], {"succeeded", "failed"})
    assert job["state"] == "succeeded", job["error"]
    assert job["bytes"] == (moved[1] - moved[0]) * BYTES_PER_TOKEN
    assert job["prompt_tokens"] == prompt


async def test_lists_without_tokens_must_hold_the_same_tokens(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    same = await client.post(TRANSFERS, json=body([0, 1], [3]), headers=WORKER)
    assert same.status == 202, await same.text()
    answer = await same.json()
    assert answer["bytes"] == 8 * BYTES_PER_TOKEN
    assert "tokens" not in answer

    response = await client.post(TRANSFERS, json=body([0, 1, 2], [3]), headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert (problem["code"], problem["field"], problem["token"]) == (
        "token_range_not_covered",
        "dst_blocks",
        8,
    )
    assert (problem["covered"], problem["tokens"]) == ([0, 8], [0, 12])


@pytest.mark.parametrize(
    ("members", "src", "dst", "expected"),
    [
        (  # the receiver's suffix list of one block starts at token 8: token 5 has no block
            {"tokens": {"start": 5, "end": 14}},
            [1, 2, 3],
            [0],
            {"code": "token_range_not_covered", "field": "dst_blocks", "token": 5,
             "covered": [8, 16], "tokens": [5, 14]},
        ),
        (  # named first tokens: the sender's list ends at token 12
            {"tokens": {"start": 5, "end": 14}, "src_first_token": 4, "dst_first_token": 0},
            [1, 2],
            [0, 1],
            {"code": "token_range_not_covered", "field": "src_blocks", "token": 12,
             "covered": [4, 12], "tokens": [5, 14]},
        ),
        (
            {"tokens": {"start": 9, "end": 9}},
            [1],
            [0],
            {"code": "invalid_transfer", "field": "tokens"},
        ),
        (  # a prompt-only job whose sender list starts after the prompt's end
            {"prompt_tokens": 14, "src_first_token": 16},
            [1],
            [2, 0],
            {"code": "invalid_transfer", "field": "src_blocks"},
        ),
        (  # three blocks of 4 cannot end at token 4
            {"tokens": {"start": 0, "end": 4}},
            [0, 1, 2],
            [0],
            {"code": "invalid_transfer", "field": "src_blocks"},
        ),
    ],
)  # fmt: skip
async def test_token_ranges_the_lists_do_not_cover_are_422_naming_the_first_gap(
    start, segment, members, src, dst, expected
) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)

    response = await client.post(TRANSFERS, json=body(src, dst) | members, headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert {key: problem[key] for key in expected} == expected
    assert await jobs.list_jobs(client.app[sessionmaker_key], "llama") == []


async def test_a_token_range_member_outside_the_schema_is_refused(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    request = body([1], [0]) | {"tokens": {"start": 0, "end": 4, "step": 1}}

    response = await client.post(TRANSFERS, json=request, headers=WORKER)

    assert response.status in (400, 422)
    assert await jobs.list_jobs(client.app[sessionmaker_key], "llama") == []
