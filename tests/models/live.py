"""Registering documents on a live kvroute and reading its verdict, over plain HTTP."""

from __future__ import annotations

from typing import Any

from kvroute.engines.models import Instance, Verdict
from kvroute.live import json_call
from tests.client.live import ADMIN_TOKEN, WORKER_TOKEN


def call(url: str, method: str, body: Any = None, *, admin: bool = False) -> tuple[int, Any]:
    return json_call(method, url, ADMIN_TOKEN if admin else WORKER_TOKEN, body)


def register_all(base: str, deployment: str, *instances: Instance) -> dict[str, Any] | None:
    """Registers every rank in order; the first refusal (with its instance and rank), or None."""
    for instance in instances:
        for rank, document in enumerate(instance.documents):
            path = f"/v1/deployments/{deployment}/instances/{instance.name}/ranks/{rank}"
            status, answer = call(base + path, "PUT", document)
            if status >= 400:
                return {**answer, "instance": instance.name, "rank": rank}
    return None


def local_refusal(verdict: Verdict) -> dict[str, Any] | None:
    """The local verdict in the members a live refusal is compared on."""
    if verdict.refusal is None:
        return None
    return {**verdict.refusal.to_problem(), "instance": verdict.instance, "rank": verdict.rank}


COMPARED = ("code", "field", "local", "peer", "peer_instance", "peer_rank", "instance", "rank")


def same_refusal(live: dict[str, Any] | None, local: dict[str, Any] | None) -> bool:
    if live is None or local is None:
        return live is local
    return all(live.get(key) == local.get(key) for key in COMPARED)
