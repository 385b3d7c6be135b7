"""Engine leases: one lease keeps many ranks; one renewal renews them, its expiry expires them.

The fencing rules are a rank's: an expired lease never comes back, a rank it keeps that expired
on its own is not revived by a renewal, and leases are judged no earlier than the deployment's
latest admission.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import update

from kvroute.api.keys import sessionmaker_key
from kvroute.store.models import RankRow
from tests.api.conftest import ADMIN, WORKER, rank_path
from tests.api.documents import rank_document

LEASES = "/v1/deployments/llama/leases"


async def _grant(client: Any, seconds: int) -> dict[str, Any]:
    response = await client.post(LEASES, json={"lease_seconds": seconds}, headers=WORKER)
    assert response.status == 201, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def _put(client: Any, instance: str, rank: int, document: dict[str, Any], lease: str | None):
    params = {"engine_lease": lease} if lease else {}
    response = await client.put(
        rank_path(instance, rank), json=document, params=params, headers=WORKER
    )
    return response.status, await response.json(content_type=None)


async def _renew(client: Any, lease: str) -> tuple[int, dict[str, Any]]:
    response = await client.post(f"{LEASES}/{lease}/heartbeat", headers=WORKER)
    return response.status, await response.json(content_type=None)


async def _state(client: Any, instance: str, rank: int) -> str:
    return str((await (await client.get(rank_path(instance, rank), headers=ADMIN)).json())["state"])


def _tp2(rank: int, **extra: Any) -> dict[str, Any]:
    return rank_document(tp_size=2, tp_rank=rank, **extra)


async def test_one_renewal_renews_every_rank_and_its_expiry_expires_them(client, clock):
    lease = await _grant(client, 3)
    assert lease["ranks"] == []
    assert lease["lease_seconds"] == 3
    for rank in (0, 1):
        status, body = await _put(
            client, "ctx0", rank, _tp2(rank, lease_seconds=60), lease["lease_id"]
        )
        assert status == 201, body
        assert body["lease_expires_at"] == lease["lease_expires_at"]  # the lease's, not 60 s
    clock.advance(2)
    status, renewed = await _renew(client, lease["lease_id"])
    assert status == 200
    assert renewed["ranks"] == [{"instance": "ctx0", "rank": 0}, {"instance": "ctx0", "rank": 1}]
    clock.advance(2)  # 4 s after the grant: live only through the renewal
    assert [await _state(client, "ctx0", rank) for rank in (0, 1)] == ["live", "live"]
    rank = await (await client.get(rank_path("ctx0", 1), headers=ADMIN)).json()
    assert rank["lease_expires_at"] == renewed["lease_expires_at"]
    clock.advance(1)  # 5 s = the renewal (2 s) + 3 s
    assert [await _state(client, "ctx0", rank) for rank in (0, 1)] == ["expired", "expired"]
    status, problem = await _renew(client, lease["lease_id"])
    assert (status, problem["code"]) == (404, "not_found")
    assert "grant a new lease" in problem["detail"]


async def test_a_kept_rank_is_renewed_only_through_its_lease(client):
    lease = await _grant(client, 30)
    await _put(client, "ctx0", 0, rank_document(), lease["lease_id"])
    response = await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)
    problem = await response.json()
    assert (response.status, problem["code"]) == (409, "rank_held_by_engine_lease")
    assert lease["lease_id"] in problem["detail"]
    # Registering again without the lease detaches the rank: its own heartbeats work again.
    status, _ = await _put(client, "ctx0", 0, rank_document(), None)
    assert status == 200
    assert (await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)).status == 200
    status, renewed = await _renew(client, lease["lease_id"])
    assert (status, renewed["ranks"]) == (200, [])


async def test_unknown_or_expired_lease_stores_nothing(client, clock):
    status, problem = await _put(client, "ctx0", 0, rank_document(), "0" * 32)
    assert (status, problem["code"]) == (404, "not_found")
    assert (await client.get(rank_path("ctx0", 0), headers=ADMIN)).status == 404
    lease = await _grant(client, 1)
    clock.advance(1)
    status, _ = await _put(client, "ctx0", 0, rank_document(), lease["lease_id"])
    assert status == 404
    assert (await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)).status == 404
    response = await client.put(
        rank_path("ctx0", 0), json=rank_document(), params={"engine_lease": "x"}, headers=WORKER
    )
    assert response.status == 422  # not a lease id: the spec's pattern


async def test_an_admission_fences_an_expired_lease_and_its_ranks(client, clock):
    lease = await _grant(client, 1)
    await _put(client, "ctx0", 0, rank_document(head_dim=16), lease["lease_id"])
    clock.advance(1.5)
    incompatible = rank_document(role="generation", head_dim=32)
    status, _ = await _put(client, "gen0", 0, incompatible, None)
    assert status == 201  # ctx0 expired: not a peer any more
    clock.advance(-1)  # a late renewal carrying an old clock reading: still judged after admission
    status, _ = await _renew(client, lease["lease_id"])
    assert status == 404
    assert await _state(client, "gen0", 0) == "live"


async def test_a_renewal_never_revives_a_rank_that_expired_on_its_own(client, clock):
    """A rank attached while a renewal committed keeps the older expiry; once that passed, the
    lease's renewals leave it expired (the keeper registers it again)."""
    lease = await _grant(client, 10)
    for rank in (0, 1):
        await _put(client, "ctx0", rank, _tp2(rank), lease["lease_id"])
    async with client.app[sessionmaker_key].begin() as session:
        await session.execute(
            update(RankRow)
            .where(RankRow.instance == "ctx0", RankRow.rank == 1)
            .values(lease_expires_at=clock() - timedelta(seconds=1))
        )
    status, renewed = await _renew(client, lease["lease_id"])
    assert (status, renewed["ranks"]) == (200, [{"instance": "ctx0", "rank": 0}])
    assert await _state(client, "ctx0", 1) == "expired"
    status, _ = await _put(client, "ctx0", 1, _tp2(1), lease["lease_id"])
    assert status == 200
    status, renewed = await _renew(client, lease["lease_id"])
    assert len(renewed["ranks"]) == 2


async def test_revoking_a_lease_removes_its_ranks(client):
    lease = await _grant(client, 30)
    for rank in (0, 1):
        await _put(client, "ctx0", rank, _tp2(rank), lease["lease_id"])
    got = await (await client.get(f"{LEASES}/{lease['lease_id']}", headers=WORKER)).json()
    assert [entry["rank"] for entry in got["ranks"]] == [0, 1]
    worker = await client.delete(f"{LEASES}/{lease['lease_id']}", headers=WORKER)
    assert worker.status == 403  # like deleting a rank: admin scope
    assert (await client.delete(f"{LEASES}/{lease['lease_id']}", headers=ADMIN)).status == 204
    assert (await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)).status == 404
    assert (await client.get(f"{LEASES}/{lease['lease_id']}", headers=WORKER)).status == 404


async def test_grant_is_bounded_by_the_schema(client):
    for seconds in (0, 86_401):
        response = await client.post(LEASES, json={"lease_seconds": seconds}, headers=WORKER)
        assert response.status == 422
