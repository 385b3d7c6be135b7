"""The states of a transfer job, shared by the data plane and the job table.

It lives outside both packages so the store (control plane, no torch) and the transfer package
(data plane) name one enum instead of two that could drift apart.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
