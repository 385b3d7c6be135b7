"""PostgreSQL statements whose text does not depend on how many rows they carry.

A batch's rows travel as one array per column and come back as rows through ``unnest``. The
statement's text is the same for one row or sixty-four, so asyncpg prepares it once per connection,
and several writes can share one statement, and one round trip, as data-modifying CTEs. Admission
writes a batch this way (``admission``, ``rank_writes``, ``events``); SQLite, where a statement
costs no round trip, keeps the ``executemany`` forms.

JSON values travel as text and are cast back: an array of JSON values that are themselves lists
would otherwise be bound as a deeper array.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import JSON, Table, Text, bindparam, cast, column, func, insert, select
from sqlalchemy.dialects.postgresql import ARRAY


def unnest_rows(
    table: Table, names: Sequence[str], prefix: str, *, numbered: str | None = None
) -> Any:
    """A derived table ``prefix`` with the columns ``names`` of ``table``, from ``unnest`` of one
    array parameter per column (see ``arrays``); JSON columns come out as text (see ``values``).
    ``numbered`` adds a column of that name: each row's position in the arrays, from 1."""
    types = [_carried(table.c[name].type) for name in names]
    parameters = (
        bindparam(f"{prefix}_{name}", type_=ARRAY(type_))
        for name, type_ in zip(names, types, strict=True)
    )
    return (
        func.unnest(*parameters)
        .table_valued(
            *(column(name, type_) for name, type_ in zip(names, types, strict=True)),
            with_ordinality=numbered,
        )
        .render_derived(name=prefix)
    )


def values(table: Table, rows: Any, names: Sequence[str]) -> list[Any]:
    """The columns ``names`` of ``unnest_rows(table, ...)`` as ``table``'s types (JSON cast back)."""
    return [
        cast(rows.c[name], JSON) if isinstance(table.c[name].type, JSON) else rows.c[name]
        for name in names
    ]


def insert_rows(table: Table, names: Sequence[str], prefix: str) -> Any:
    """``INSERT INTO table (names) SELECT ... FROM unnest(...)``; parameters from ``arrays``."""
    rows = unnest_rows(table, names, prefix)
    return insert(table).from_select(list(names), select(*values(table, rows, names)))


def arrays(
    table: Table, rows: Sequence[Mapping[str, Any]], names: Sequence[str], prefix: str
) -> dict[str, list[Any]]:
    """The parameters of ``unnest_rows(table, names, prefix)`` carrying ``rows``."""
    return {f"{prefix}_{name}": _column(table, name, [row[name] for row in rows]) for name in names}


def _column(table: Table, name: str, items: list[Any]) -> list[Any]:
    if not isinstance(table.c[name].type, JSON):
        return items
    # SQL NULL for None, as the JSON(none_as_null=True) columns store it; no column here keeps a
    # JSON null.
    return [None if item is None else json.dumps(item) for item in items]


def _carried(type_: Any) -> Any:
    return Text() if isinstance(type_, JSON) else type_
