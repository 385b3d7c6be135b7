"""Which KV heads a TP rank holds (docs/geometry.md rule 1), and the head total two peers agree on.

Heads are assigned contiguously. With H heads and TP t: if t <= H, rank r holds [r*H/t, (r+1)*H/t);
if t > H, rank r holds head floor(r*H/t) and each head lives on t/H ranks. The total is never derived
as per-rank x TP when a rank holds one head: that over-counts replicated heads (the most common bug
class in the peers' connectors). Without declared totals, the largest total consistent with both
sides is used: a smaller true total only relabels replicas, so the bytes moved are the same.
"""

from __future__ import annotations

from dataclasses import dataclass


def divides_one_another(tp: int, total: int) -> bool:
    return total % tp == 0 or tp % total == 0


def per_rank_heads(total: int, tp: int) -> int:
    return max(1, total // tp)


def head_range(total: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The half-open range of heads (of ``total``) held by ``tp_rank`` of a DP group of size ``tp``."""
    if tp <= total:
        per_rank = total // tp
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    head = tp_rank * total // tp
    return head, head + 1


def possible_totals(heads: int, tp: int) -> frozenset[int]:
    """Every total that gives ``heads`` per rank over ``tp`` ranks under rule 1."""
    if heads > 1:
        return frozenset({heads * tp})
    return frozenset(d for d in range(1, tp + 1) if tp % d == 0)


def declared_total_problem(heads: int, total: int, tp: int) -> str | None:
    """Why a declared total contradicts the per-rank count, or None when it agrees."""
    if not divides_one_another(tp, total):
        return f"TP {tp} and total_kv_heads {total} do not divide one another"
    if heads != per_rank_heads(total, tp):
        return (
            f"{total} KV heads over TP {tp} give {per_rank_heads(total, tp)} heads per rank, "
            f"not num_kv_heads={heads}"
        )
    return None


@dataclass(frozen=True, slots=True)
class PairTotal:
    """The head total a matched view pair is planned with, or why none exists."""

    total: int | None
    problem: str | None = None


def pair_total(
    local_heads: int,
    local_tp: int,
    local_declared: int | None,
    peer_heads: int,
    peer_tp: int,
    peer_declared: int | None,
) -> PairTotal:
    local = {local_declared} if local_declared else possible_totals(local_heads, local_tp)
    peer = {peer_declared} if peer_declared else possible_totals(peer_heads, peer_tp)
    common = local & peer
    if common:
        return PairTotal(max(common))
    return PairTotal(
        None,
        f"no KV-head total fits both sides: local {local_heads} heads/rank over TP {local_tp} "
        f"(total {_describe(local)}), peer {peer_heads} heads/rank over TP {peer_tp} "
        f"(total {_describe(peer)})",
    )


def _describe(totals: set[int] | frozenset[int]) -> str:
    ordered = sorted(totals)
    return str(ordered[0]) if len(ordered) == 1 else "one of " + ", ".join(map(str, ordered))
