"""The consumer's plan prefetcher (``kvroute.engines.vllm.prefetch``) across a kvroute outage.

A plan stays valid until its producer's generation changes: with kvroute really stopped, the
plans fetched keep serving (pulls go on without kvroute); once kvroute is back the prefetcher
fetches them again, and a producer that registered anew (a new generation) is planned for anew.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvroute.client import KvrouteClient, KvrouteError
from kvroute.engines.vllm.prefetch import Fetched, Prefetcher
from tests.client.live import WORKER_TOKEN, LiveServer
from tests.documents import rank_document

pytestmark = pytest.mark.slow


def wait_for(predicate: Callable[[], object], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def plan_of(prefetcher: Prefetcher, producer: str) -> Fetched | None:
    found = prefetcher.get(producer)
    return found if found is not None and found.plan is not None else None


def generations(fetched: Fetched | None) -> set[int | None]:
    if fetched is None or fetched.plan is None:
        return set()
    return set(fetched.plan.sender_generations.values())


async def test_plans_outlive_a_kvroute_outage_until_the_producer_registers_again(
    restartable_server: LiveServer,
) -> None:
    await asyncio.to_thread(_scenario, restartable_server)


def _scenario(server: LiveServer) -> None:
    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        client.register("pf", "p0", 0, rank_document(role="context", lease_seconds=600))
        client.register("pf", "d0", 0, rank_document(role="generation", lease_seconds=600))
    prefetcher = Prefetcher(server.url, WORKER_TOKEN, "pf", "d0", 0)
    try:
        wait_for(lambda: plan_of(prefetcher, "p0"), 30)
        before = plan_of(prefetcher, "p0")
        assert before is not None
        server.stop()
        wait_for(lambda: prefetcher.streams_lost >= 1, 30)
        ended = time.monotonic()
        while time.monotonic() - ended < 5:  # refetches after the stream ended found no kvroute
            assert prefetcher.get("p0") is before
            time.sleep(0.1)
        server.start()
        wait_for(lambda: plan_of(prefetcher, "p0") is not before, 30)  # fetched again
        again = plan_of(prefetcher, "p0")
        assert again is not None
        assert again.plan == before.plan  # the same generation: the same plan
        with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
            document = rank_document(role="context", lease_seconds=600, tokens_per_block=8)
            registered = client.register("pf", "p0", 0, document)
        wait_for(lambda: registered.generation in generations(plan_of(prefetcher, "p0")), 30)
        fresh = plan_of(prefetcher, "p0")
        assert fresh is not None
        assert fresh.documents[0]["tokens_per_block"] == 8
        assert registered.generation not in generations(before)
    finally:
        prefetcher.close()


async def test_a_consumer_whose_own_lease_lapsed_keeps_its_plans_until_it_registers_again(
    live_server: LiveServer,
) -> None:
    await asyncio.to_thread(_lapsed, live_server)


def _lapsed(server: LiveServer) -> None:
    """The consumer's lease lapses (as after a kvroute outage longer than the lease): kvroute's
    ``rank_expired`` event makes the prefetcher fetch again, and kvroute refuses the plan with
    ``receiver_not_live``, which says nothing of the producer: the plan held keeps serving. The
    consumer's registration again (its lease keeper's) brings a fresh fetch."""
    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        client.register("lapse", "p0", 0, rank_document(role="context", lease_seconds=600))
        client.register("lapse", "d0", 0, rank_document(role="generation", lease_seconds=1))
        prefetcher = Prefetcher(server.url, WORKER_TOKEN, "lapse", "d0", 0)
        try:
            wait_for(lambda: plan_of(prefetcher, "p0"), 30)
            before = plan_of(prefetcher, "p0")
            time.sleep(4)  # the lease lapsed, kvroute announced it, the refetch was refused
            with pytest.raises(KvrouteError) as refused:
                client.get_plan("lapse", sender="p0", receiver="d0", receiver_rank=0)
            assert (refused.value.status, refused.value.code) == (409, "receiver_not_live")
            assert prefetcher.get("p0") is before
            client.register("lapse", "d0", 0, rank_document(role="generation", lease_seconds=600))
            wait_for(lambda: plan_of(prefetcher, "p0") is not before, 30)
            again = plan_of(prefetcher, "p0")
            assert again is not None
            assert before is not None
            assert again.plan == before.plan  # the producer never changed
        finally:
            prefetcher.close()
