"""Plans end to end: the example deployment of docs/api.md "Plans" registered over HTTP, plans executed on bytes.

Context TP4 holds 8 target KV heads (2 per rank) and the 1-head draft layer (replicated on every
rank); generation TP2 holds 4 target heads per rank. Every rank's document and pool contents come
from ``tests/world.py``, which lays out and shards one logical KV tensor from first principles,
never through the planner. Each receiver rank's plan is fetched over HTTP and executed with numpy:
every destination byte must be written exactly once, with its logical element, and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.api.conftest import WORKER, rank_path
from tests.executor import Request, execute
from tests.truth import Truth
from tests.world import Layout, Side, ViewClass, layout_rank

Client = TestClient[web.Request, web.Application]
HEAD_DIM, TOKENS, LAYERS = 128, 32, 32
UNIT = HEAD_DIM * 2  # bf16 bytes per token-head
CLASSES = [
    ViewClass(("key", "value"), "target", "hnd", total_heads=8, buffers=2, unit=UNIT),
    ViewClass(("key", "value"), "draft", "hnd", total_heads=1, buffers=2, unit=UNIT),
]
CONTEXT = Side(
    "context",
    tp_size=4,
    layers_per_stage=(LAYERS,),
    tokens_per_block=TOKENS,
    head_dim=HEAD_DIM,
    num_draft_layers=1,
    seed=11,
)
GENERATION = Side(
    "generation",
    tp_size=2,
    layers_per_stage=(LAYERS,),
    tokens_per_block=TOKENS,
    head_dim=HEAD_DIM,
    num_draft_layers=1,
    seed=12,
)
SRC_BLOCKS, DST_BLOCKS, CONTENT = [2, 0], [1, 2], [5, 3]


async def _register(client: Client, side: Side, name: str) -> dict[int, Layout]:
    layouts = {rank: layout_rank(side, CLASSES, rank) for rank in range(side.tp_size)}
    for rank, layout in layouts.items():
        response = await client.put(rank_path(name, rank), json=layout.doc, headers=WORKER)
        assert response.status == 201, await response.text()
    return layouts


async def _plan(client: Client, rank: int) -> dict[str, Any]:
    query = {"sender": "ctx0", "receiver": "gen0", "receiver_rank": str(rank)}
    response = await client.get("/v1/deployments/llama/plans", params=query, headers=WORKER)
    assert response.status == 200, await response.text()
    return dict(await response.json())


def _views(plan: dict[str, Any], rank: int) -> list[str]:
    peer = next(peer for peer in plan["peers"] if peer["rank"] == rank)
    return [view["owner"] for view in peer["views"] if view["fragments"]]


async def test_api_md_example_plans_move_every_byte_exactly_once(client: Client) -> None:
    truth = Truth(CLASSES)
    senders = await _register(client, CONTEXT, "ctx0")
    receivers = await _register(client, GENERATION, "gen0")
    sender_pools = {
        rank: truth.fill(CONTEXT, layout, rank, SRC_BLOCKS, CONTENT)
        for rank, layout in senders.items()
    }
    for rank, layout in receivers.items():
        plan = await _plan(client, rank)
        out, writes = execute(plan, sender_pools, senders, layout, Request(SRC_BLOCKS, DST_BLOCKS))
        expected = truth.fill(GENERATION, layout, rank, DST_BLOCKS, CONTENT)
        for pool, wanted in expected.items():
            destination = wanted != 0
            assert destination.any()
            assert np.array_equal(writes[pool][destination], np.ones(destination.sum()))
            assert not writes[pool][~destination].any(), "bytes outside the KV regions written"
            assert np.array_equal(out[pool], wanted)

        senders_heard = [2 * rank, 2 * rank + 1]
        assert [peer["rank"] for peer in plan["peers"]] == senders_heard
        assert plan["expected_writers"] == 2
        if rank == 0:
            # docs/api.md "Plans": the replicated draft head is written by the elected rank 0 only.
            assert (_views(plan, 0), _views(plan, 1)) == (["target", "draft"], ["target"])
            assert [peer["bytes_per_block"] for peer in plan["peers"]] == [1064960, 1048576]
