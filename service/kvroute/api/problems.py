"""RFC 9457 problem details: the one shape of every error kvroute answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_BASE = "https://kvroute.dev/problems/"
# A 503 is always temporary for kvroute (draining, database trouble, a replica without the data
# plane): clients back off this long unless the problem says otherwise.
DEFAULT_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Problem:
    """An error answer before it is rendered; ``extras`` become top-level members."""

    status: int
    title: str
    detail: str
    code: str
    extras: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_json(self, *, request_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": PROBLEM_BASE + self.code.replace("_", "-"),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        body.update(self.extras)
        if request_id is not None:
            body["request_id"] = request_id
        return body

    def to_response(self, *, request_id: str | None) -> web.Response:
        headers = dict(self.headers)
        if self.status == 503:
            headers.setdefault("Retry-After", str(DEFAULT_RETRY_AFTER_S))
        return web.json_response(
            self.to_json(request_id=request_id),
            status=self.status,
            content_type=PROBLEM_CONTENT_TYPE,
            headers=headers,
        )


class ProblemError(Exception):
    """Raised by middlewares and handlers to answer a ``Problem`` through the error boundary."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.detail)
        self.problem = problem
