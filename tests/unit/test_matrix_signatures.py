"""Property test: the matrix computes a cell once per pair of instance signatures
(``control.compatibility.compatibility_matrix``) and still gives every cell the answer of checking
that pair alone, rank by rank, with ``check_peers``.

Hypothesis draws context and generation instances of one to three TP ranks whose documents differ
in head_dim (so instances share signatures, differ in them, or mix classes within one instance) and
that may lack ranks. The model: a pair is incomplete when either side lacks a rank; otherwise the
first generation rank, in rank order, that ``check_peers`` refuses against all the context's live
ranks names the refusal (its code, field, values and ranks), and no such rank means compatible.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.control.compatibility import InstanceRanks, compatibility_matrix
from kvroute.geometry import GeometryError, RankRegistration, check_peers
from tests.documents import rank_document


@st.composite
def instance(draw: st.DrawFn, name: str, role: str) -> InstanceRanks:
    size = draw(st.integers(1, 3))
    head_dims = draw(st.lists(st.sampled_from([16, 32]), min_size=size, max_size=size))
    present = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    ranks = tuple(
        RankRegistration.from_json(
            rank_document(role=role, tp_size=size, tp_rank=rank, head_dim=head_dim),
            deployment="d",
            instance=name,
            rank=rank,
        )
        for rank, (head_dim, live) in enumerate(zip(head_dims, present, strict=True))
        if live or draw(st.integers(0, 3)) > 0  # mostly complete
    )
    return InstanceRanks(name, role, size, ranks)


def expected(context: InstanceRanks, generation: InstanceRanks) -> dict[str, Any]:
    if context.missing or generation.missing:
        return {"status": "incomplete"}
    for receiver in generation.live:
        try:
            check_peers(receiver, list(context.live))
        except GeometryError as error:
            return {
                "status": "incompatible",
                "code": error.code,
                "field": error.field,
                "local": error.local,
                "peer": error.peer,
                "generation_rank": receiver.rank,
                "context_rank": error.peer_rank,
            }
    return {"status": "compatible"}


def seen(cell: Any) -> dict[str, Any]:
    if cell.status != "incompatible":
        return {"status": cell.status}
    keys = ("code", "field", "local", "peer", "generation_rank", "context_rank")
    return {"status": cell.status, **{key: cell.refusal[key] for key in keys}}


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    contexts=st.lists(st.integers(), min_size=1, max_size=4).flatmap(
        lambda items: st.tuples(*(instance(f"ctx{i}", "context") for i in range(len(items))))
    ),
    generations=st.lists(st.integers(), min_size=1, max_size=4).flatmap(
        lambda items: st.tuples(*(instance(f"gen{i}", "generation") for i in range(len(items))))
    ),
)
def test_every_cell_is_its_own_pairs_check(contexts, generations) -> None:
    matrix = compatibility_matrix("d", [*contexts, *generations], {})
    cells = iter(matrix.pairs)
    for context in contexts:
        for generation in generations:
            cell = next(cells)
            assert (cell.context, cell.generation) == (context.name, generation.name)
            assert seen(cell) == expected(context, generation)
    assert next(cells, None) is None
