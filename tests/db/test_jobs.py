"""Transfer-job persistence: forward-only state machine and restart recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvroute.store import jobs
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import InvalidTransition, NotFound
from kvroute.store.models import JobState
from kvroute.wire import TransferJob, TransferRequest
from tests.db.documents import T0

LATER = T0 + timedelta(seconds=2)


async def new_job(
    sessionmaker: SessionMaker, deployment: str = "llama", replica: str = ""
) -> TransferJob:
    request = TransferRequest(
        sender="ctx0", receiver="gen0", receiver_ranks=(0, 1), src_blocks=(3, 4), dst_blocks=(7, 8)
    )
    new = jobs.NewJob(
        deployment=deployment,
        request=request,
        plan_fingerprint="sha256:abc",
        bytes_total=2**40,  # beyond 32 bits: the columns are BIGINT
        fragments=12,
    )
    return await jobs.create_job(sessionmaker, new, now=T0, replica=replica)


async def test_created_job_is_queued_and_readable(sessionmaker: SessionMaker) -> None:
    job = await new_job(sessionmaker)

    stored = await jobs.get_job(sessionmaker, job.id)

    assert stored == job
    assert (stored.state, stored.bytes, stored.blocks) == ("queued", 2**40, 2)
    assert stored.started_at is stored.finished_at is None
    with pytest.raises(NotFound):
        await jobs.get_job(sessionmaker, "00000000-0000-0000-0000-000000000000")


async def test_job_runs_to_success_with_timestamps(sessionmaker: SessionMaker) -> None:
    job = await new_job(sessionmaker)

    running = await jobs.set_state(sessionmaker, job.id, JobState.RUNNING, now=T0)
    done = await jobs.set_state(sessionmaker, job.id, JobState.SUCCEEDED, now=LATER)

    assert (running.state, running.started_at, running.finished_at) == ("running", T0, None)
    assert (done.state, done.started_at, done.finished_at) == ("succeeded", T0, LATER)


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ((), JobState.SUCCEEDED),  # a queued job never ran
        ((JobState.RUNNING,), JobState.QUEUED),
        ((JobState.CANCELLED,), JobState.RUNNING),
        ((JobState.RUNNING, JobState.FAILED), JobState.CANCELLED),
    ],
)
async def test_state_only_moves_forward(
    sessionmaker: SessionMaker, path: tuple[JobState, ...], refused: JobState
) -> None:
    job = await new_job(sessionmaker)
    for state in path:
        await jobs.set_state(sessionmaker, job.id, state, now=T0)

    with pytest.raises(InvalidTransition, match=refused.value):
        await jobs.set_state(sessionmaker, job.id, refused, now=LATER)
    assert (await jobs.get_job(sessionmaker, job.id)).state == (path[-1] if path else "queued")


async def test_set_state_on_unknown_job_is_not_found(sessionmaker: SessionMaker) -> None:
    with pytest.raises(NotFound):
        await jobs.set_state(sessionmaker, "missing", JobState.RUNNING, now=T0)


async def test_restart_fails_jobs_that_were_in_flight(sessionmaker: SessionMaker) -> None:
    queued, running, finished = [await new_job(sessionmaker) for _ in range(3)]
    await jobs.set_state(sessionmaker, running.id, JobState.RUNNING, now=T0)
    await jobs.set_state(sessionmaker, finished.id, JobState.RUNNING, now=T0)
    await jobs.set_state(sessionmaker, finished.id, JobState.SUCCEEDED, now=T0)

    assert await jobs.mark_interrupted(sessionmaker, now=LATER) == 2

    for job in (queued, running):
        stored = await jobs.get_job(sessionmaker, job.id)
        assert (stored.state, stored.error, stored.finished_at) == (
            "failed",
            jobs.INTERRUPTED,
            LATER,
        )
    assert (await jobs.get_job(sessionmaker, finished.id)).state == "succeeded"


async def test_a_restart_fails_only_its_own_replica_jobs(sessionmaker: SessionMaker) -> None:
    mine = await new_job(sessionmaker, replica="kvroute-0")
    theirs = await new_job(sessionmaker, replica="kvroute-1")
    await jobs.set_state(sessionmaker, theirs.id, JobState.RUNNING, now=T0)

    assert await jobs.mark_interrupted(sessionmaker, now=LATER, replica="kvroute-0") == 1

    assert (await jobs.get_job(sessionmaker, mine.id)).state == "failed"
    assert (await jobs.get_job(sessionmaker, theirs.id)).state == "running"


async def test_list_jobs_is_per_deployment(sessionmaker: SessionMaker) -> None:
    mine = await new_job(sessionmaker, "llama")
    await new_job(sessionmaker, "other")

    assert [job.id for job in await jobs.list_jobs(sessionmaker, "llama")] == [mine.id]
