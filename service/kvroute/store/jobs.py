"""Persistence of transfer jobs: the durable side of the transfer worker pool.

A job's state only moves forward (queued -> running -> succeeded|failed|cancelled, or straight from
queued to cancelled/failed). Each transition is one conditional UPDATE, so two actors racing on a
job (a cancel and a worker picking it up) cannot both win. Jobs in flight when kvroute stopped are
failed on the next start by :func:`mark_interrupted`, since their worker threads died with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update

from kvroute import wire
from kvroute.store.engine import SessionMaker, affected_rows, reading
from kvroute.store.errors import InvalidTransition, NotFound
from kvroute.store.models import JobState, TransferJob

INTERRUPTED = "interrupted by kvroute restart"

# The states a job may be in for it to move to the key state.
_PREDECESSORS: dict[JobState, tuple[JobState, ...]] = {
    JobState.QUEUED: (),
    JobState.RUNNING: (JobState.QUEUED,),
    JobState.SUCCEEDED: (JobState.RUNNING,),
    JobState.FAILED: (JobState.QUEUED, JobState.RUNNING),
    JobState.CANCELLED: (JobState.QUEUED, JobState.RUNNING),
}


@dataclass(frozen=True, slots=True)
class NewJob:
    """What a transfer job's row is created from: who sends what to whom, and what the plan moves."""

    deployment: str
    sender: str
    receiver: str
    receiver_ranks: Sequence[int]
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]
    plan_fingerprint: str
    bytes_total: int
    fragments: int
    # The request's token members, as given (None: not given).
    tokens: tuple[int, int] | None = None
    src_first_token: int | None = None
    dst_first_token: int | None = None
    src_state_slot: int | None = None
    dst_state_slot: int | None = None
    prompt_tokens: int | None = None


async def create_job(
    sessionmaker: SessionMaker,
    new: NewJob,
    *,
    now: datetime,
    replica: str = "",
    job_id: str | None = None,
) -> wire.TransferJob:
    """Stores ``new`` as a queued job under ``job_id`` (a fresh UUID by default) and returns it."""
    job = TransferJob(
        id=job_id or str(uuid.uuid4()),
        deployment=new.deployment,
        sender=new.sender,
        receiver=new.receiver,
        receiver_ranks=list(new.receiver_ranks),
        src_blocks=list(new.src_blocks),
        dst_blocks=list(new.dst_blocks),
        state=JobState.QUEUED.value,
        bytes=new.bytes_total,
        fragments=new.fragments,
        plan_fingerprint=new.plan_fingerprint,
        replica=replica,
        created_at=now,
        tokens_start=new.tokens[0] if new.tokens else None,
        tokens_end=new.tokens[1] if new.tokens else None,
        src_first_token=new.src_first_token,
        dst_first_token=new.dst_first_token,
        src_state_slot=new.src_state_slot,
        dst_state_slot=new.dst_state_slot,
        prompt_tokens=new.prompt_tokens,
    )
    async with sessionmaker.begin() as session:
        session.add(job)
    return _record(job)


async def discard_job(sessionmaker: SessionMaker, job_id: str) -> None:
    """Deletes a queued job that never reached a worker (its submission was refused)."""
    async with sessionmaker.begin() as session:
        await session.execute(
            delete(TransferJob).where(
                TransferJob.id == job_id, TransferJob.state == JobState.QUEUED.value
            )
        )


async def get_job(sessionmaker: SessionMaker, job_id: str) -> wire.TransferJob:
    async with reading(sessionmaker) as session:
        job = await session.get(TransferJob, job_id)
    if job is None:
        raise NotFound(f"transfer job {job_id!r} does not exist")
    return _record(job)


async def set_state(
    sessionmaker: SessionMaker,
    job_id: str,
    state: JobState,
    *,
    now: datetime,
    error: str | None = None,
) -> wire.TransferJob:
    """Moves a job to ``state``, stamping started_at (running) or finished_at (terminal states).

    Raises ``NotFound`` for an unknown job and ``InvalidTransition`` when the job's current state
    does not lead to ``state`` (e.g. cancelling a job that already succeeded).
    """
    values: dict[str, object] = {"state": state.value, "error": error}
    if state is JobState.RUNNING:
        values["started_at"] = now
    if state.terminal:
        values["finished_at"] = now
    allowed = [predecessor.value for predecessor in _PREDECESSORS[state]]
    async with sessionmaker.begin() as session:
        moved = await affected_rows(
            session,
            update(TransferJob)
            .where(TransferJob.id == job_id, TransferJob.state.in_(allowed))
            .values(**values)
            .execution_options(synchronize_session=False),
        )
        job = await session.get(TransferJob, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"transfer job {job_id!r} does not exist")
    if moved == 0:
        raise InvalidTransition(f"transfer job {job_id!r} is {job.state}; it cannot become {state}")
    return _record(job)


async def mark_interrupted(sessionmaker: SessionMaker, *, now: datetime, replica: str = "") -> int:
    """Fails the replica's queued or running jobs (its previous workers are gone); returns how many.

    Jobs of other replicas sharing the database are left alone: their workers are alive.
    """
    async with sessionmaker.begin() as session:
        return await affected_rows(
            session,
            update(TransferJob)
            .where(
                TransferJob.replica == replica,
                TransferJob.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]),
            )
            .values(state=JobState.FAILED.value, error=INTERRUPTED, finished_at=now),
        )


async def list_jobs(
    sessionmaker: SessionMaker, deployment: str, *, limit: int = 100
) -> list[wire.TransferJob]:
    """A deployment's newest jobs, newest first."""
    async with reading(sessionmaker) as session:
        jobs = await session.scalars(
            select(TransferJob)
            .where(TransferJob.deployment == deployment)
            .order_by(TransferJob.created_at.desc(), TransferJob.id)
            .limit(limit)
        )
        return [_record(job) for job in jobs]


def _record(job: TransferJob) -> wire.TransferJob:
    duration = None
    if job.started_at is not None and job.finished_at is not None:
        duration = (job.finished_at - job.started_at).total_seconds()
    return wire.TransferJob(
        id=job.id,
        deployment=job.deployment,
        sender=job.sender,
        receiver=job.receiver,
        receiver_ranks=tuple(job.receiver_ranks),
        blocks=len(job.src_blocks),
        state=job.state,
        bytes=job.bytes,
        fragments=job.fragments,
        duration_seconds=duration,
        error=job.error,
        plan_fingerprints=tuple(job.plan_fingerprint.split(",")),
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        tokens=_tokens(job),
        src_first_token=job.src_first_token,
        dst_first_token=job.dst_first_token,
        src_state_slot=job.src_state_slot,
        dst_state_slot=job.dst_state_slot,
        prompt_tokens=job.prompt_tokens,
    )


def _tokens(job: TransferJob) -> wire.TokenRange | None:
    if job.tokens_start is None or job.tokens_end is None:
        return None
    return wire.TokenRange(start=job.tokens_start, end=job.tokens_end)
