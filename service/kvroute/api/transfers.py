"""Transfer job endpoints, and the worker pool's lifetime inside the app.

The data plane needs torch, which the control-plane image does not install: the pool's cleanup
context imports it lazily and, without it, the app serves everything else while ``POST`` and
``DELETE`` answer 503 naming the missing extra. ``GET`` reads the job table only, so any replica
(with or without a data plane) answers it. The transfer package's errors are translated here,
since importing them outside this lazily-entered path would import torch.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import datetime
from typing import TYPE_CHECKING

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now, clock_key
from kvroute.api.keys import (
    copy_engine_key,
    inventory_key,
    metrics_key,
    plan_service_key,
    sessionmaker_key,
    settings_key,
    transfer_service_key,
    validated_key,
)
from kvroute.api.problems import Problem, ProblemError

if TYPE_CHECKING:
    from kvroute.control.transfers import TransferService

log = logging.getLogger(__name__)

NO_DATA_PLANE = (
    "this kvroute process runs without the transfer data plane (torch is not installed; "
    "install kvroute[transfer]); submit transfers to a replica that has it"
)


async def transfer_context(app: web.Application) -> AsyncIterator[None]:
    """Start the worker pool; on shutdown (readiness is already 503) drain it, then unmap pools."""
    try:
        from kvroute.control.transfers import TransferService
        from kvroute.transfer.backends import default_backends
        from kvroute.transfer.opened import PoolMemoryCache
    except ImportError as error:
        log.warning("transfer endpoints disabled: %s (%s)", NO_DATA_PLANE, error)
        yield
        return
    settings = app[settings_key]
    service = TransferService(
        app[sessionmaker_key],
        app[plan_service_key],
        workers=settings.transfer_workers,
        queue_size=settings.transfer_queue_size,
        registry=app[metrics_key].registry,
        engine=app.get(copy_engine_key),
        memories=PoolMemoryCache(
            default_backends(
                shm_name_prefix=settings.shm_name_prefix, shm_owners=settings.shm_owner_uids
            ),
            max_open=settings.transfer_max_open_pools,
        ),
        replica=settings.replica_id,
        clock=app[clock_key],
    )
    await service.start(now=app_now(app))
    app[transfer_service_key] = service
    yield
    report = await service.close(settings.shutdown_timeout_seconds)
    if not report.clean:
        log.warning("transfer jobs abandoned at shutdown: %s", ", ".join(report.abandoned))


def pools_deleted(app: web.Application, deployment: str, instance: str, rank: int | None) -> None:
    """A rank (or a whole instance) was deleted: its idle pools are closed now, busy ones after
    their last job. Nothing to do where this process has no data plane."""
    service = app.get(transfer_service_key)
    if service is not None:
        service.pools.deleted(deployment, instance, rank)


def pools_registered(
    app: web.Application, deployment: str, instance: str, rank: int, generation: int
) -> None:
    """A rank registered at ``generation``: pools of its earlier generations are done with."""
    service = app.get(transfer_service_key)
    if service is not None:
        service.pools.registered(deployment, instance, rank, generation)


async def sweep_pools(app: web.Application, now: datetime) -> None:
    """On each reaper round: close pools of ranks that expired or changed on other replicas."""
    service = app.get(transfer_service_key)
    if service is not None:
        await service.pools.sweep(now=now)


def transfer_checks(app: web.Application) -> dict[str, str]:
    """The readiness entry of the worker pool; none where this process has no data plane."""
    service = app.get(transfer_service_key)
    return {} if service is None else {"transfer_pool": service.readiness()}


async def post_transfer(request: web.Request) -> web.Response:
    service = _service(request.app)
    validated = request[validated_key]
    transfer = wire.from_json(wire.TransferRequest, validated.body)  # the schema checked it
    deployment = validated.path["deployment"]
    # Refusals raise; the error table answers them.
    record = await service.submit(deployment, transfer, now=app_now(request.app))
    return web.json_response(
        wire.to_json(record), status=202, headers={"Location": f"/v1/transfers/{record.id}"}
    )


async def get_transfer(request: web.Request) -> web.Response:
    job_id = request[validated_key].path["job_id"]
    record = await request.app[inventory_key].transfer_job(job_id)
    return web.json_response(wire.to_json(record))


async def list_transfers(request: web.Request) -> web.Response:
    validated = request[validated_key]
    deployment = validated.path["deployment"]
    records = await request.app[inventory_key].transfer_jobs(
        deployment, limit=validated.query.get("limit", 100)
    )
    return web.json_response(
        {"deployment": deployment, "transfers": [wire.to_json(record) for record in records]}
    )


async def delete_transfer(request: web.Request) -> web.Response:
    service = _service(request.app)
    job_id = request[validated_key].path["job_id"]
    record = await service.cancel(job_id, now=app_now(request.app))
    return web.json_response(wire.to_json(record))


def _service(app: web.Application) -> TransferService:
    service = app.get(transfer_service_key)
    if service is None:
        raise ProblemError(Problem(503, "Service Unavailable", NO_DATA_PLANE, "no_data_plane"))
    return service
