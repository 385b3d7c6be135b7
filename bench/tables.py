"""The benchmarks' result tables: label columns on the left, figures right-justified after them."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table


def figures_table(title: str, labels: Iterable[str], figures: Iterable[str]) -> Table:
    """A ``rich`` table whose ``labels`` columns name a row and whose ``figures`` columns (one per
    configuration, tree or measure, then any ratios) hold numbers."""
    table = Table(title=title)
    for label in labels:
        table.add_column(label)
    for figure in figures:
        table.add_column(figure, justify="right")
    return table
