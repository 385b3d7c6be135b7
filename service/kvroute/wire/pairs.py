"""The pairing answers' shapes: a deployment's pairing policy and, per generation instance, the
context instances it may pair with (best first) and why each other one is excluded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvroute.wire.codec import OMIT_NONE


@dataclass(frozen=True, slots=True)
class Pairing:
    """A deployment's policy: topology domains pairs must share, and ones preferred, best first."""

    require: tuple[str, ...]
    prefer: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PairChoice:
    """A context instance a generation instance may pair with; ``preference`` 1 is the best."""

    context: str
    preference: int
    shared_domains: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PairExclusion:
    """A context instance a generation instance may not pair with, and the first reason:
    ``instance_incomplete``, a registration refusal's code (``model_revision_mismatch``, ...) or
    ``topology_domain_required``; ``local`` is the generation side's value, ``peer`` the context's."""

    context: str
    code: str
    detail: str
    field: str | None = field(default=None, metadata=OMIT_NONE)
    local: Any = None
    peer: Any = None


@dataclass(frozen=True, slots=True)
class GenerationPairs:
    instance: str
    complete: bool
    domains: dict[str, Any]  # domain -> its value, the values of a split instance, or None
    pairs: tuple[PairChoice, ...]  # best first
    excluded: tuple[PairExclusion, ...]  # by context instance name


@dataclass(frozen=True, slots=True)
class Pairs:
    """``GET /v1/deployments/{d}/pairs``: what a router may pair, per generation instance."""

    deployment: str
    pairing: Pairing
    generation: tuple[GenerationPairs, ...]  # by instance name
