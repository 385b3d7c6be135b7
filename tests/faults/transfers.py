"""A context rank and a generation rank whose pools are shm segments of a separate worker process."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvroute.live import json_call
from tests.documents import rank_document
from tests.faults.conftest import WORKER_TOKEN
from tests.transfer.conftest import Owners

POLL_S = 0.05
JOB_WAIT_S = 60.0
TRANSFERS = "/v1/deployments/llama/transfers"


def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """One request with the worker token: (status, JSON body); no retries, unlike the client."""
    return json_call(method, url, WORKER_TOKEN, body)


@dataclass(frozen=True)
class World:
    """What was registered: each instance's pool memory (its segment name for shm) and size."""

    memories: dict[str, dict[str, Any]]
    pool_bytes: int

    @property
    def segments(self) -> dict[str, str]:
        return {instance: memory["name"] for instance, memory in self.memories.items()}


def register_world(
    base: str,
    owners: Owners,
    *,
    num_layers: int = 4,
    head_dim: int = 16,
    num_slots: int = 8,
    sealed: bool = False,
) -> World:
    """ctx0 and gen0 (TP1 each, identical geometry): every block copies one whole slot. Pools are
    plain shm segments, or sealed memfds (``sealed``) of the owner process."""
    memories: dict[str, dict[str, Any]] = {}
    size = 0
    for role, instance in (("context", "ctx0"), ("generation", "gen0")):
        document = rank_document(
            role=role, num_layers=num_layers, head_dim=head_dim, num_slots=num_slots
        )
        pool = document["pools"][0]
        size = pool["slot_stride"] * pool["num_slots"]
        if sealed:
            memories[instance] = owners.memfd("workers", size, seed=len(memories))
        else:
            name = owners.create("workers", size, seed=len(memories))
            memories[instance] = {"backend": "shm", "name": name}
        pool["memory"] = memories[instance]
        path = f"/v1/deployments/llama/instances/{instance}/ranks/0"
        status, answer = call("PUT", base + path, document)
        assert status == 201, answer
    return World(memories, size)


def submit(base: str, blocks: list[int]) -> tuple[int, Any]:
    body = {
        "sender": "ctx0",
        "receiver": "gen0",
        "receiver_ranks": [0],
        "src_blocks": blocks,
        "dst_blocks": blocks,
    }
    return call("POST", base + TRANSFERS, body)


def wait_final(base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_WAIT_S
    while time.monotonic() < deadline:
        _, job = call("GET", f"{base}/v1/transfers/{job_id}")
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(POLL_S)
    raise AssertionError(f"job {job_id} did not finish within {JOB_WAIT_S} s")
