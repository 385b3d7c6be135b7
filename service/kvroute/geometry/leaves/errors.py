"""The one error type for geometry refusals.

Every refusal names the offending field and both values, so an operator can act on it without reading
kvroute's source, and carries a stable ``code`` that clients and metrics can switch on.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

Stage = Literal["schema", "self", "instance", "peer", "plan", "plan_document", "request"]

_TITLES: dict[Stage, str] = {
    "schema": "Malformed registration document",
    "self": "Inconsistent rank geometry",
    "instance": "Rank disagrees with its instance",
    "peer": "Incompatible with a peer rank",
    "plan": "No transfer plan possible",
    "plan_document": "Malformed plan document",
    "request": "The request lacks what this geometry needs",
}


class Ranked(Protocol):
    """A rank as refusals and checks name it: its instance and its rank there."""

    @property
    def instance(self) -> str: ...
    @property
    def rank(self) -> int: ...


class GeometryError(ValueError):
    """A registration or plan request that can never transfer correctly."""

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        field: str,
        local: Any = None,
        peer: Any = None,
        stage: Stage = "self",
        peer_instance: str | None = None,
        peer_rank: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.field = field
        self.local = local
        self.peer = peer
        self.stage: Stage = stage
        self.peer_instance = peer_instance
        self.peer_rank = peer_rank

    @classmethod
    def against(
        cls,
        peer: Ranked,
        code: str,
        detail: str,
        *,
        field: str,
        local: Any,
        theirs: Any,
        stage: Stage = "peer",
    ) -> GeometryError:
        """A refusal found comparing with ``peer`` (another instance's rank, or at ``stage``
        "instance" one of the same instance): names it, and the value it holds."""
        error = cls(code, detail, field=field, local=local, peer=theirs, stage=stage)
        error.peer_instance, error.peer_rank = peer.instance, peer.rank
        return error

    def to_problem(self) -> dict[str, Any]:
        """The RFC 9457 members of this refusal; the HTTP layer adds ``status``."""
        problem: dict[str, Any] = {
            "type": f"https://kvroute.dev/problems/{self.code.replace('_', '-')}",
            "title": _TITLES[self.stage],
            "detail": self.detail,
            "code": self.code,
            "field": self.field,
            "local": self.local,
            "peer": self.peer,
        }
        if self.peer_instance is not None:
            problem["peer_instance"] = self.peer_instance
            problem["peer_rank"] = self.peer_rank
        return problem

    def __repr__(self) -> str:
        return f"GeometryError({self.code!r}, field={self.field!r}, local={self.local!r}, peer={self.peer!r})"
