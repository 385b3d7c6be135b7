"""Pairing for routers: per generation instance, the context instances it may pair with, best first,
and the first reason each other one may not (``GET /v1/deployments/{d}/pairs``), under the
deployment's pairing policy (``geometry.domains``), which operators set on the deployment.

A pair is excluded when either instance is incomplete (``instance_incomplete``), when registration
would refuse it (the matrix's first refusal: ``model_revision_mismatch``, ``head_dim_mismatch``,
...) or when the two do not share a required topology domain (``topology_domain_required``).
Allowed pairs are ordered by the preferred domains they share (the first preferred domain outranks
all later ones), then by name; pairs sharing the same preferred domains have the same
``preference`` (1 is the best), so a router may spread load among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from kvroute import wire
from kvroute.control import kv_paths
from kvroute.control.answers import AnswerSources, Rendered, cached_answer
from kvroute.control.compatibility import InstanceRanks, compatibility_matrix
from kvroute.geometry.checks.classes import VerdictMemo
from kvroute.geometry.registration.domains import (
    PairingPolicy,
    preference_key,
    required_exclusion,
    shared_domains,
)
from kvroute.store import pairing as store
from kvroute.store import registry as records
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import NotFound

INCOMPLETE = "instance_incomplete"


async def deployment_pairs(
    sources: AnswerSources,
    deployment: str,
    *,
    now: datetime,
    generation: str | None = None,
) -> Rendered:
    """The pairs answer of every generation instance, or of ``generation`` alone."""

    failed = await kv_paths.failed_paths(sources.sessionmaker, deployment, now=now)

    def compute(
        instances: list[InstanceRanks], memo: VerdictMemo, policy: PairingPolicy
    ) -> wire.Pairs:
        if generation is not None and not any(
            item.name == generation and item.role == "generation" for item in instances
        ):
            raise NotFound(f"generation instance {generation!r} of {deployment!r} does not exist")
        matrix = compatibility_matrix(deployment, instances, memo, only=generation)
        return pairs_answer(deployment, instances, matrix, policy, generation, failed)

    name = ("pairs", deployment, *(() if generation is None else (generation,)))
    # The failed paths are an input: a new failure (or one gone stale) renders the answer again.
    extra = tuple(sorted((key, path.reported_at) for key, path in failed.items()))
    return await cached_answer(
        sources,
        name,
        compute,
        deployment=deployment,
        now=now,
        domains=True,
        extra=extra,
    )


def pairs_answer(
    deployment: str,
    instances: Sequence[InstanceRanks],
    matrix: wire.Compatibility,
    policy: PairingPolicy,
    only: str | None = None,
    failed: kv_paths.FailedPaths | None = None,
) -> wire.Pairs:
    cells = {(cell.generation, cell.context): cell for cell in matrix.pairs}
    contexts = sorted((item for item in instances if item.role == "context"), key=_name)
    domains = {item.name: item.domains for item in instances}
    answers = []
    for gen in sorted(instances, key=_name):
        if gen.role != "generation" or only not in (None, gen.name):
            continue
        allowed, excluded = [], []
        mine = domains[gen.name]
        for ctx in contexts:
            theirs = domains[ctx.name]
            reason = _exclusion(cells[gen.name, ctx.name], policy, mine, theirs)
            if reason is None and (path := (failed or {}).get((gen.name, ctx.name))):
                reason = kv_paths.exclusion(path)
            if reason is not None:
                excluded.append(wire.PairExclusion(context=ctx.name, **reason))
            else:
                # Without preferred domains every allowed pair ranks alike: no key to compute.
                key = preference_key(policy, mine, theirs) if policy.prefer else ()
                allowed.append((key, ctx.name, tuple(shared_domains(mine, theirs))))
        answers.append(
            wire.GenerationPairs(
                instance=gen.name,
                complete=not gen.missing,
                domains=domains[gen.name],
                pairs=_ranked(sorted(allowed)),
                excluded=tuple(excluded),
            )
        )
    return wire.Pairs(
        deployment=deployment,
        pairing=wire.Pairing(require=policy.require, prefer=policy.prefer),
        generation=tuple(answers),
    )


def _name(item: InstanceRanks) -> str:
    return item.name


def _ranked(allowed: list[tuple[tuple[int, ...], str, tuple[str, ...]]]) -> tuple[Any, ...]:
    """Dense preference numbers: pairs sharing the same preferred domains rank alike."""
    numbers = {key: number for number, key in enumerate(sorted({key for key, _, _ in allowed}), 1)}
    return tuple(
        wire.PairChoice(context=name, preference=numbers[key], shared_domains=shared)
        for key, name, shared in allowed
    )


def _exclusion(
    cell: wire.CompatibilityPair, policy: PairingPolicy, mine: Any, theirs: Any
) -> dict[str, Any] | None:
    if cell.status == "incomplete":
        missing = cell.missing_ranks or {}
        described = "; ".join(f"{name} lacks ranks {ranks}" for name, ranks in missing.items())
        return {
            "code": INCOMPLETE,
            "detail": f"not every rank is live: {described}",
            "local": missing.get(cell.generation, []),
            "peer": missing.get(cell.context, []),
        }
    if cell.status == "incompatible" and cell.refusal is not None:
        refusal = cell.refusal
        return {key: refusal[key] for key in ("code", "field", "detail", "local", "peer")}
    if not policy.require:
        return None  # no domain is required: nothing to look up
    return required_exclusion(policy, (cell.generation, mine), (cell.context, theirs))


async def set_pairing(
    sessionmaker: SessionMaker, deployment: str, document: dict[str, Any] | None, *, now: datetime
) -> wire.Deployment:
    """Stores the deployment's policy (None or an empty one clears it) and answers the deployment;
    a bad policy raises ``invalid_document`` naming the member, before anything is stored."""
    policy = PairingPolicy.from_json(document)
    stored = None if policy.empty else policy.to_json()
    await store.set_pairing_policy(sessionmaker, deployment, stored)
    return await records.get_deployment(sessionmaker, deployment, now=now)
