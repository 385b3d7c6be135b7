"""A replica that has parsed nothing answers the matrix and the pairs exactly as the replica that
admitted the fleet, on both databases, while parsing only the first rank of each class and the
ranks its refusals name (``control.matrix_reads``).

The fleet has several classes per instance (PP stages), instances of different TP, an incomplete
instance, topology domains under a pairing policy, and a generation instance admitted without
checks (an older kvroute's row) that every context instance refuses.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.api.keys import registry_key
from tests.api.conftest import register
from tests.api.test_compatibility import admit_without_checks, matrix
from tests.api.test_pairs import pairs, policy
from tests.documents import rank_document

Client = TestClient[web.Request, web.Application]

# instance: (role, tp_size, pp_size, zone, ranks registered)
FLEET = {
    "ctx0": ("context", 1, 2, "a", 2),
    "ctx1": ("context", 1, 2, "b", 2),
    "ctx2": ("context", 2, 1, "a", 2),
    "ctx3": ("context", 2, 1, "b", 1),  # incomplete
    "gen0": ("generation", 1, 1, "a", 1),
    "gen1": ("generation", 2, 2, "b", 4),
    "gen2": ("generation", 2, 1, "a", 2),
}


def document(role: str, tp_size: int, pp_size: int, rank: int, zone: str) -> dict[str, Any]:
    doc = rank_document(
        role=role, tp_size=tp_size, tp_rank=rank % tp_size, pp_size=pp_size, pp_rank=rank // tp_size
    )
    doc["topology"] = {"zone": zone}
    return doc


async def test_a_fresh_replica_answers_as_the_warm_one(
    client: Client, make_client: Callable[..., Awaitable[Client]]
) -> None:
    for name, (role, tp_size, pp_size, zone, count) in FLEET.items():
        for rank in range(count):
            status, body = await register(
                client, name, rank, document(role, tp_size, pp_size, rank, zone)
            )
            assert status == 201, body
    refused = rank_document(role="generation", head_dim=32)
    await admit_without_checks(client, "gen3", 0, refused)
    assert (await policy(client, {"prefer": ["zone"]}))[0] == 200

    warm = (await matrix(client), await pairs(client), await pairs(client, "?generation=gen3"))
    statuses = {cell["status"] for cell in warm[0]["pairs"]}
    assert statuses == {"compatible", "incompatible", "incomplete"}

    fresh_client = await make_client()
    fresh = (
        await matrix(fresh_client),
        await pairs(fresh_client),
        await pairs(fresh_client, "?generation=gen3"),
    )
    assert fresh == warm
    # 15 live ranks; parsed: a first rank per class (ctx0's 2, ctx2's, gen0's, gen1's 2, gen2's,
    # gen3's) and the ranks gen3's refusals name (gen3 rank 0 and the complete contexts' firsts
    # of each class), fewer than every rank.
    parsed = len(fresh_client.app[registry_key].registrations)
    assert 0 < parsed < 15
