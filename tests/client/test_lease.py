"""The lease keeper: heartbeats at lease/3, and re-registers when kvroute forgot the rank."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import pytest

from kvroute.client import AsyncKvrouteClient, KvrouteClient, LeaseKeeper, RetryPolicy
from tests.api.documents import rank_document
from tests.client.live import ADMIN_TOKEN, WORKER_TOKEN, LiveServer

pytestmark = pytest.mark.slow

PATIENT = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.2)


async def wait_for(predicate: Callable[[], bool], limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_interval_is_a_third_of_the_lease() -> None:
    client = AsyncKvrouteClient("http://127.0.0.1:1")
    keeper = LeaseKeeper(client, "d", "i", 0, rank_document(lease_seconds=9))
    assert keeper.interval == 3.0


async def test_a_failed_renewal_is_retried_within_seconds_not_an_interval(
    restartable_server: LiveServer,
) -> None:
    """kvroute really stopped (SIGSTOP: no answer at all) across one renewal, then resumed: the
    keeper renews within seconds of kvroute's return, not one interval (8 s here) after its
    failed renewal, so an outage shorter than the lease never ends it."""
    process = restartable_server.process
    assert process is not None
    loop = asyncio.get_running_loop()
    async with AsyncKvrouteClient(
        restartable_server.url, token=WORKER_TOKEN, timeout=1.0, retry=RetryPolicy(attempts=1)
    ) as client:
        keeper = LeaseKeeper(
            client, "lease", "ctx0", 0, rank_document(lease_seconds=60), interval=8
        )
        async with keeper:
            process.send_signal(signal.SIGSTOP)
            try:
                await wait_for(lambda: keeper.last_error is not None, limit_s=20)
            finally:
                process.send_signal(signal.SIGCONT)
            resumed = loop.time()
            await wait_for(lambda: keeper.heartbeats >= 1, limit_s=6)
            assert keeper.last_error is None
            assert loop.time() - resumed < 4
            assert keeper.reregistrations == 0  # the same lease, renewed in time


async def test_keeper_heartbeats_and_reregisters_after_restart_on_fresh_db(
    restartable_server: LiveServer,
) -> None:
    document = rank_document(lease_seconds=30)
    async with AsyncKvrouteClient(
        restartable_server.url, token=WORKER_TOKEN, retry=PATIENT
    ) as client:
        keeper = LeaseKeeper(client, "lease", "ctx0", 0, document, interval=0.2)
        async with keeper:
            assert keeper.generation == 1
            await wait_for(lambda: keeper.heartbeats >= 2)
            before_restart = keeper.reregistrations
            await asyncio.to_thread(restartable_server.restart, fresh_db=True)
            registered = await keeper.wait_reregistered(limit_s=15, since=before_restart)
            info = await client.get_rank("lease", "ctx0", 0)
            assert registered.created  # the fresh database had never seen it
            assert info.document["views"] == document["views"]
            assert keeper.reregistrations == 1
            before = keeper.heartbeats
            await wait_for(lambda: keeper.heartbeats > before)  # and renewing again


async def test_keeper_survives_restart_on_same_db_without_reregistering(
    restartable_server: LiveServer,
) -> None:
    async with (
        AsyncKvrouteClient(restartable_server.url, token=WORKER_TOKEN, retry=PATIENT) as client,
        # A lease longer than a restart takes on the loaded machine (imports alone took 30 s).
        LeaseKeeper(
            client, "lease", "ctx0", 0, rank_document(lease_seconds=600), interval=0.2
        ) as keeper,
    ):
        await asyncio.to_thread(restartable_server.restart, fresh_db=False)
        before = keeper.heartbeats
        await wait_for(lambda: keeper.heartbeats >= before + 2)
        assert keeper.reregistrations == 0
        assert keeper.generation == 1


def test_sync_lease_reregisters_after_an_admin_delete(live_server: LiveServer) -> None:
    with (
        KvrouteClient(live_server.url, token=WORKER_TOKEN) as worker,
        KvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin,
    ):
        lease = worker.keep_lease(
            "synclease", "gen0", 0, rank_document(role="generation"), interval=0.1
        )
        with lease:
            before_delete = lease.keeper.reregistrations
            admin.deregister("synclease", "gen0", 0)
            worker._run(lease.keeper.wait_reregistered(limit_s=10, since=before_delete))
            assert admin.get_rank("synclease", "gen0", 0).state == "live"
            assert lease.keeper.running
        assert not lease.keeper.running  # leaving the block stopped the heartbeat task


def test_sync_engine_lease_keeps_ranks_until_stopped(live_server: LiveServer) -> None:
    documents = {("ctx0", rank): rank_document(tp_size=2, tp_rank=rank) for rank in (0, 1)}
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        with client.keep_engine_lease("syncengine", documents, interval=0.1) as kept:
            lease_id = kept.keeper.lease_id
            assert lease_id is not None
            lease = client.get_lease("syncengine", lease_id)
            assert [(rank.instance, rank.rank) for rank in lease.ranks] == [
                ("ctx0", 0),
                ("ctx0", 1),
            ]
            renewed = client.renew_lease("syncengine", lease_id)
            assert len(renewed.ranks) == 2
            assert kept.keeper.running
        assert not kept.keeper.running  # leaving the block stopped the renewals


async def test_engine_keeper_keeps_many_ranks_under_one_lease(live_server: LiveServer) -> None:
    documents = {("ctx0", rank): rank_document(tp_size=2, tp_rank=rank) for rank in (0, 1)}
    async with (
        AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN, retry=PATIENT) as client,
        AsyncKvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin,
        client.keep_engine_lease("engine", documents, interval=0.2) as keeper,
    ):
        assert keeper.lease_id is not None
        lease = await client.get_lease("engine", keeper.lease_id)
        assert [(kept.instance, kept.rank) for kept in lease.ranks] == [("ctx0", 0), ("ctx0", 1)]
        await wait_for(lambda: keeper.heartbeats >= 2)
        before = keeper.reregistrations
        await admin.deregister("engine", "ctx0", 1)
        await keeper.wait_reregistered(limit_s=10, since=before)
        lease = await client.get_lease("engine", keeper.lease_id)
        assert len(lease.ranks) == 2  # registered again, with the same lease
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        keeper = client.keep_lease(
            "engine", "gen0", 0, rank_document(role="generation"), interval=0.2, per_rank=True
        )
        async with keeper:
            assert keeper.lease_id is None
            await wait_for(lambda: keeper.heartbeats >= 1)
