"""Errors the data plane raises, one type per HTTP answer the REST layer gives.

The transfer package never imports aiohttp; the error middleware maps these types once:
``PoolMemoryError`` and ``TransferValidationError`` -> 422, ``QueueFull`` -> 429 with
``Retry-After``, ``PoolDraining`` and ``PoolsExhausted`` -> 503 (the latter with ``Retry-After``),
``UnknownJob`` -> 404.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error raised by kvroute.transfer."""


class PoolMemoryError(TransferError):
    """A pool's memory cannot be opened (missing segment, wrong size, no CUDA, bad descriptor)."""

    def __init__(
        self,
        pool_id: int | None,
        backend: str,
        reason: str,
        *,
        instance: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.pool_id = pool_id
        self.backend = backend
        self.reason = reason
        self.instance = instance  # the rank whose pool it is, once the caller knows it
        self.rank = rank
        owner = f" of {instance} rank {rank}" if instance is not None else ""
        super().__init__(f"pool {pool_id}{owner} ({backend} memory): {reason}")

    def of_rank(self, instance: str, rank: int) -> PoolMemoryError:
        """The same failure, naming the rank whose pool could not be opened."""
        return PoolMemoryError(
            self.pool_id, self.backend, self.reason, instance=instance, rank=rank
        )


class TransferValidationError(TransferError, ValueError):
    """A plan or a job that can never copy correctly; ``field`` names the offending input.

    ``code`` is the problem code the REST layer answers with; ``extras`` are further members of its
    problem body (a token range's first gap names the token and the list's coverage).
    """

    def __init__(
        self,
        field: str,
        detail: str,
        *,
        code: str = "invalid_transfer",
        extras: dict[str, object] | None = None,
    ) -> None:
        self.field = field
        self.detail = detail
        self.code = code
        self.extras = extras or {}
        super().__init__(f"{field}: {detail}")


class QueueFull(TransferError):
    """The worker pool's queue is at capacity; retry after ``retry_after`` seconds."""

    def __init__(self, queue_size: int, retry_after: float) -> None:
        self.queue_size = queue_size
        self.retry_after = retry_after
        super().__init__(f"transfer queue is full ({queue_size} jobs); retry in {retry_after:g} s")


class PoolsExhausted(TransferError):
    """This process cannot map another pool now: its bound of open pools is held by running jobs,
    or the system refused a descriptor or a mapping. Retry after ``retry_after`` seconds."""

    def __init__(self, reason: str, retry_after: float = 1.0) -> None:
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(f"cannot open another pool now: {reason}; retry in {retry_after:g} s")


class PoolDraining(TransferError):
    """The worker pool is draining or stopped and accepts no new jobs."""

    def __init__(self) -> None:
        super().__init__("the transfer worker pool is not accepting jobs (draining or stopped)")


class UnknownJob(TransferError, KeyError):
    """No job with this id is known to the worker pool."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(job_id)

    def __str__(self) -> str:
        return f"no transfer job {self.job_id!r}"
