"""PostgreSQL statements whose text does not depend on how many rows they carry.

A batch's rows of one table travel as one JSON text (an array of objects) and come back as rows
through ``json_to_recordset``, typed by the table's own column types. The statement's text is the
same for one row or sixty-four, so asyncpg prepares it once per connection, and several writes can
share one statement, and one round trip, as data-modifying CTEs. Admission writes a batch this way
(``admission``, ``rank_writes``, ``events``); SQLite, where a statement costs no round trip, keeps
the ``executemany`` forms.

One text per table rather than one typed array per column: asyncpg encodes an array element by
element in Python (an ABC check and a codec call each), which cost an admission batch of eight
ranks more CPU on the event loop than its JSON does (``docs/performance.md``). A JSON column's
value is written as a nested JSON value, and ``json_to_recordset`` hands its text back verbatim,
so the stored JSON is the text ``json.dumps`` gives the value alone; a None is SQL NULL, as the
JSON(none_as_null=True) columns store it (no column here keeps a JSON null).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Table,
    Text,
    bindparam,
    cast,
    column,
    func,
    insert,
    select,
)


def unnest_rows(
    table: Table, names: Sequence[str], prefix: str, *, numbered: str | None = None
) -> Any:
    """A derived table ``prefix`` with the columns ``names`` of ``table``, from the rows of the
    JSON text parameter ``prefix`` (see ``arrays``). ``numbered`` adds an integer column of that
    name: each row's position in the text, from 1 (``arrays`` must be given the same name)."""
    columns = [column(name, table.c[name].type) for name in names]
    if numbered is not None:
        columns.append(column(numbered, BigInteger()))
    return (
        func.json_to_recordset(cast(bindparam(prefix, type_=Text()), JSON))
        .table_valued(*columns)
        .render_derived(name=prefix, with_types=True)
    )


def values(table: Table, rows: Any, names: Sequence[str]) -> list[Any]:
    """The columns ``names`` of ``unnest_rows(table, ...)``, typed as ``table``'s."""
    return [rows.c[name] for name in names]


def insert_rows(table: Table, names: Sequence[str], prefix: str) -> Any:
    """``INSERT INTO table (names) SELECT ... FROM json_to_recordset(...)``; parameters from
    ``arrays``."""
    rows = unnest_rows(table, names, prefix)
    return insert(table).from_select(list(names), select(*values(table, rows, names)))


def arrays(
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    prefix: str,
    *,
    numbered: str | None = None,
) -> dict[str, str]:
    """The parameter of ``unnest_rows(table, names, prefix)`` carrying ``rows`` (each holds at
    least the keys ``names``; others are ignored)."""
    if numbered is not None:
        rows = [{**row, numbered: position} for position, row in enumerate(rows, 1)]
    return {prefix: json.dumps(rows, default=_timestamp)}


def _timestamp(value: Any) -> str:
    """A timestamp as ``timestamptz`` reads it (what UTCDateTime binds: aware UTC only)."""
    if not isinstance(value, datetime):
        raise TypeError(f"{type(value).__name__} is not JSON serializable")
    if value.tzinfo is None:
        raise ValueError(f"naive datetime {value!r}: kvroute stores timezone-aware UTC only")
    return value.astimezone(UTC).isoformat()
