"""A blocking facade over the async client for workers whose main loop is not asyncio.

The async client runs on a private event loop in a daemon thread, so a lease keeper started from
blocking code keeps heartbeating while the worker's own thread is busy in a forward pass. There is
one implementation: each blocking method is the async client's own (``blocking``), submitted to
that loop and waited for, with its signature and docstring; the lease keepers are the async
client's too, started on the loop (``started``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, Self, TypeVar

from kvroute.client.aio import AsyncKvrouteClient
from kvroute.client.http import DEFAULT_TIMEOUT_S
from kvroute.client.lease import EngineLeaseKeeper, LeaseKeeper
from kvroute.client.retry import RetryPolicy

LOOP_CHECK_S = 0.5  # how often a waiting call looks whether the client's loop still runs
P = ParamSpec("P")
T = TypeVar("T")
K = TypeVar("K", bound="Startable")
W = TypeVar("W")


class Startable(Protocol):
    async def start(self) -> object: ...


def blocking(
    method: Callable[Concatenate[AsyncKvrouteClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[KvrouteClient, P], T]:
    """The async client's ``method`` as a blocking one: run on the client's loop, waited for."""

    @functools.wraps(method)
    def run(self: KvrouteClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self.aio, *args, **kwargs))

    return run


def started(
    method: Callable[Concatenate[AsyncKvrouteClient, P], K],
    handle: Callable[[KvrouteClient, K], W],
) -> Callable[Concatenate[KvrouteClient, P], W]:
    """The async client's keeper ``method``, its keeper started on the client's loop and handed
    back as ``handle`` (which stops it there)."""

    @functools.wraps(method)
    def run(self: KvrouteClient, /, *args: P.args, **kwargs: P.kwargs) -> W:
        keeper = method(self.aio, *args, **kwargs)

        async def start() -> K:
            await keeper.start()
            return keeper

        return handle(self, self._run(start()))

    run.__doc__ = (
        f"``with client.{method.__name__}(...)``: registers, then renews in the background until "
        "``stop()`` or the block's end (``AsyncKvrouteClient``'s keeper, on the client's loop)."
    )
    return run


class SyncEngineLease:
    """An engine lease keeper running on the client's loop; ``stop()`` ends the renewals."""

    def __init__(self, client: KvrouteClient, keeper: EngineLeaseKeeper) -> None:
        self._client = client
        self.keeper = keeper

    def stop(self, *, deregister: bool = False) -> None:
        self._client._run(self.keeper.stop(deregister=deregister))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncLease(SyncEngineLease):
    """A one-rank lease keeper running on the client's loop; ``stop()`` ends the heartbeats."""

    keeper: LeaseKeeper

    def __init__(self, client: KvrouteClient, keeper: LeaseKeeper) -> None:
        super().__init__(client, keeper)

    @property
    def generation(self) -> int | None:
        return self.keeper.generation


class KvrouteClient:
    """``with KvrouteClient(url, token=...) as client: client.register(...)``: every method of
    ``AsyncKvrouteClient``, blocking."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvroute-client", daemon=True
        )
        self._thread.start()
        self.aio = AsyncKvrouteClient(base_url, token=token, timeout=timeout, retry=retry)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the kvroute client is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        # A call that reaches the loop after ``close`` stopped it would wait forever (and keep its
        # thread, and so the process, from ending): wait while the loop's thread runs.
        while True:
            try:
                return future.result(timeout=LOOP_CHECK_S)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    future.cancel()
                    coroutine.close()  # not run to its end: the loop that would run it is gone
                    raise RuntimeError("the kvroute client is closed") from None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.aio.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Registration and leases.
    register = blocking(AsyncKvrouteClient.register)
    grant_lease = blocking(AsyncKvrouteClient.grant_lease)
    renew_lease = blocking(AsyncKvrouteClient.renew_lease)
    get_lease = blocking(AsyncKvrouteClient.get_lease)
    revoke_lease = blocking(AsyncKvrouteClient.revoke_lease)
    heartbeat = blocking(AsyncKvrouteClient.heartbeat)
    get_rank = blocking(AsyncKvrouteClient.get_rank)
    deregister = blocking(AsyncKvrouteClient.deregister)
    keep_lease = started(AsyncKvrouteClient.keep_lease, SyncLease)
    keep_engine_lease = started(AsyncKvrouteClient.keep_engine_lease, SyncEngineLease)

    # Plans and transfers.
    get_plan = blocking(AsyncKvrouteClient.get_plan)
    get_plans = blocking(AsyncKvrouteClient.get_plans)
    submit_transfer = blocking(AsyncKvrouteClient.submit_transfer)
    get_transfer = blocking(AsyncKvrouteClient.get_transfer)
    cancel_transfer = blocking(AsyncKvrouteClient.cancel_transfer)
    wait_transfer = blocking(AsyncKvrouteClient.wait_transfer)

    # Admin reads.
    deployments = blocking(AsyncKvrouteClient.deployments)
    instances = blocking(AsyncKvrouteClient.instances)
    instance = blocking(AsyncKvrouteClient.instance)
    delete_instance = blocking(AsyncKvrouteClient.delete_instance)
    rejections = blocking(AsyncKvrouteClient.rejections)
    compatibility = blocking(AsyncKvrouteClient.compatibility)
    pairs = blocking(AsyncKvrouteClient.pairs)

    # KV integrity per transfer path.
    report_kv_path = blocking(AsyncKvrouteClient.report_kv_path)
    kv_paths = blocking(AsyncKvrouteClient.kv_paths)
    put_kv_digest = blocking(AsyncKvrouteClient.put_kv_digest)
    kv_digests = blocking(AsyncKvrouteClient.kv_digests)
