"""The one exception a worker catches: every refusal and every unreachable service.

kvroute answers errors as RFC 9457 problem+json; a worker must be able to act on the members
(``code``, ``field``, ``local``, ``peer``, the peer's instance and rank) without parsing prose, so
they become attributes here. A service that cannot be reached after the retries is the same type
with ``status`` None, so one ``except KvrouteError`` covers everything the client can raise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KvrouteError(Exception):
    """A refusal by kvroute (``status`` set) or a service out of reach (``status`` None)."""

    def __init__(
        self,
        status: int | None,
        code: str,
        detail: str,
        *,
        title: str | None = None,
        field: str | None = None,
        local: Any = None,
        peer: Any = None,
        peer_instance: str | None = None,
        peer_rank: int | None = None,
        request_id: str | None = None,
        problem: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status or 'unreachable'} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title
        self.field = field
        self.local = local
        self.peer = peer
        self.peer_instance = peer_instance
        self.peer_rank = peer_rank
        self.request_id = request_id
        self.problem: dict[str, Any] = dict(problem or {})

    @classmethod
    def from_problem(cls, status: int, body: Any, *, reason: str = "") -> KvrouteError:
        """Builds the error from a problem+json body; a non-problem body keeps its status."""
        if not isinstance(body, Mapping):
            text = str(body)[:500] if body else reason
            return cls(status, reason.lower().replace(" ", "_") or "http_error", text)
        return cls(
            status,
            str(body.get("code") or reason.lower().replace(" ", "_") or "http_error"),
            str(body.get("detail") or body.get("title") or reason),
            title=body.get("title"),
            field=body.get("field"),
            local=body.get("local"),
            peer=body.get("peer"),
            peer_instance=body.get("peer_instance"),
            peer_rank=body.get("peer_rank"),
            request_id=body.get("request_id"),
            problem=body,
        )

    @classmethod
    def unreachable(cls, code: str, detail: str) -> KvrouteError:
        return cls(None, code, detail)

    @property
    def retryable(self) -> bool:
        """What the client retries on its own: no answer, 429 (queue full) and 503 (draining)."""
        return self.status is None or self.status in (429, 503)

    @property
    def not_found(self) -> bool:
        return self.status == 404
