"""Persistence of transfer jobs: the durable side of the transfer worker pool.

A job's state only moves forward (queued -> running -> succeeded|failed|cancelled, or straight from
queued to cancelled/failed). Each transition is one conditional UPDATE, so two actors racing on a
job (a cancel and a worker picking it up) cannot both win. Jobs in flight when kvroute stopped are
failed on the next start by :func:`mark_interrupted`, since their worker threads died with it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update

from kvroute import wire
from kvroute.store.engine import SessionMaker, affected_rows, reading
from kvroute.store.errors import InvalidTransition, NotFound
from kvroute.store.models import JobState, TransferJobRow

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
    """What a transfer job's row is created from: the request as given (in ``deployment``) and
    what its plans move."""

    deployment: str
    request: wire.TransferRequest
    plan_fingerprint: str
    bytes_total: int
    fragments: int


async def create_job(
    sessionmaker: SessionMaker,
    new: NewJob,
    *,
    now: datetime,
    replica: str = "",
    job_id: str | None = None,
) -> wire.TransferJob:
    """Stores ``new`` as a queued job under ``job_id`` (a fresh UUID by default) and returns it."""
    request = new.request
    job = TransferJobRow(
        id=job_id or str(uuid.uuid4()),
        deployment=new.deployment,
        sender=request.sender,
        receiver=request.receiver,
        receiver_ranks=list(request.receiver_ranks),
        src_blocks=list(request.src_blocks),
        dst_blocks=list(request.dst_blocks),
        state=JobState.QUEUED.value,
        bytes=new.bytes_total,
        fragments=new.fragments,
        plan_fingerprint=new.plan_fingerprint,
        replica=replica,
        created_at=now,
        **_option_columns(request),
    )
    async with sessionmaker.begin() as session:
        session.add(job)
    return _record(job)


async def discard_job(sessionmaker: SessionMaker, job_id: str) -> None:
    """Deletes a queued job that never reached a worker (its submission was refused)."""
    async with sessionmaker.begin() as session:
        await session.execute(
            delete(TransferJobRow).where(
                TransferJobRow.id == job_id, TransferJobRow.state == JobState.QUEUED.value
            )
        )


async def get_job(sessionmaker: SessionMaker, job_id: str) -> wire.TransferJob:
    async with reading(sessionmaker) as session:
        job = await session.get(TransferJobRow, job_id)
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
            update(TransferJobRow)
            .where(TransferJobRow.id == job_id, TransferJobRow.state.in_(allowed))
            .values(**values)
            .execution_options(synchronize_session=False),
        )
        job = await session.get(TransferJobRow, job_id, populate_existing=True)
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
            update(TransferJobRow)
            .where(
                TransferJobRow.replica == replica,
                TransferJobRow.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]),
            )
            .values(state=JobState.FAILED.value, error=INTERRUPTED, finished_at=now),
        )


async def list_jobs(
    sessionmaker: SessionMaker, deployment: str, *, limit: int = 100
) -> list[wire.TransferJob]:
    """A deployment's newest jobs, newest first."""
    async with reading(sessionmaker) as session:
        jobs = await session.scalars(
            select(TransferJobRow)
            .where(TransferJobRow.deployment == deployment)
            .order_by(TransferJobRow.created_at.desc(), TransferJobRow.id)
            .limit(limit)
        )
        return [_record(job) for job in jobs]


def _record(job: TransferJobRow) -> wire.TransferJob:
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
        **_options(job),
    )


# The request's options are columns of their own names, but for the range's two ends.
_INTEGER_OPTIONS = tuple(name for name in wire.OPTION_NAMES if name != "tokens")


def _option_columns(options: wire.TransferOptions) -> dict[str, int | None]:
    tokens = options.tokens
    return {
        "tokens_start": None if tokens is None else tokens.start,
        "tokens_end": None if tokens is None else tokens.end,
        **{name: value for name, value in options.options().items() if name != "tokens"},
    }


def _options(job: TransferJobRow) -> dict[str, Any]:
    """The request's options as its row holds them."""
    tokens = None
    if job.tokens_start is not None and job.tokens_end is not None:
        tokens = wire.TokenRange(start=job.tokens_start, end=job.tokens_end)
    return {"tokens": tokens, **{name: getattr(job, name) for name in _INTEGER_OPTIONS}}
