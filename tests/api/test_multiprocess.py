"""Two live ``kvroute serve`` processes on one PostgreSQL database admit one of two rivals.

The processes share no memory; only the database lock taken by
the registry serializes them. Incompatible context and generation instances register at
the same moment, one through each process: exactly one may be admitted, every round.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.api.documents import rank_document

ROUNDS = 5
STARTUP_SECONDS = 30.0
REQUEST_SECONDS = 15.0

pytestmark = pytest.mark.postgres


async def _put(session: aiohttp.ClientSession, url: str, document: dict) -> int:
    async with session.put(url, json=document) as response:
        return response.status


async def test_two_processes_admit_exactly_one_of_two_incompatible_instances(servers):
    timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for round_number in range(ROUNDS):
            deployment = f"race{round_number}"
            first, second = servers if round_number % 2 == 0 else servers[::-1]
            statuses = await asyncio.gather(
                _put(
                    session,
                    f"{first}/v1/deployments/{deployment}/instances/ctx0/ranks/0",
                    rank_document(role="context", head_dim=16),
                ),
                _put(
                    session,
                    f"{second}/v1/deployments/{deployment}/instances/gen0/ranks/0",
                    rank_document(role="generation", head_dim=32),
                ),
            )
            assert sorted(statuses) == [201, 409], (deployment, statuses)
            async with session.get(f"{first}/v1/deployments/{deployment}/instances") as response:
                instances = (await response.json())["instances"]
            admitted = "ctx0" if statuses[0] == 201 else "gen0"
            assert [instance["name"] for instance in instances] == [admitted]
