"""The compatibility matrix as a picture: one cell per (generation, context) instance pair.

Rows are generation instances, columns context instances. A cell is green (compatible), red
with the refusal's code (incompatible) or grey (incomplete: missing ranks, not checked); each
red cell is numbered and spelled out below the grid with its field and both values, so the
picture alone says why a pair cannot transfer. Works on the ``/compatibility`` JSON document.
"""

from __future__ import annotations

from typing import Any

from kvroute.pictures.svg import CHAR_WIDTH, LINE, Canvas

CELL_HEIGHT = 40
FILLS = {"compatible": "#59a14f", "incompatible": "#e15759", "incomplete": "#d0d0d0"}


def _ranks(instance: dict[str, Any]) -> str:
    live, expected = len(instance["live_ranks"]), instance["expected_ranks"]
    return f"{live}/{expected} live"


def _cell_label(pair: dict[str, Any], number: int | None) -> str:
    if pair["status"] == "compatible":
        return "ok"
    if pair["status"] == "incomplete":
        return f"[{number}] incomplete"
    return f"[{number}] {pair['refusal']['code']}"


def _explanation(pair: dict[str, Any]) -> str:
    if pair["status"] == "incomplete":
        missing = "; ".join(
            f"{name} misses ranks {','.join(map(str, ranks))}"
            for name, ranks in pair.get("missing_ranks", {}).items()
        )
        return f"{pair['generation']} <- {pair['context']}: incomplete ({missing})"
    refusal = pair["refusal"]
    return (
        f"{pair['generation']} rank {refusal['generation_rank']} <- {pair['context']} rank "
        f"{refusal['context_rank']}: {refusal['code']}, field {refusal['field']}: "
        f"generation={refusal['local']!r}, context={refusal['peer']!r}"
    )


def compatibility_svg(matrix: dict[str, Any]) -> str:
    """The matrix picture (see the module docstring) as a standalone SVG document."""
    canvas = Canvas()
    contexts, generations = matrix["context"], matrix["generation"]
    refused = [p for p in matrix["pairs"] if p["status"] != "compatible"]
    numbers = {(p["generation"], p["context"]): n for n, p in enumerate(refused, start=1)}
    canvas.text(
        10,
        24,
        f"compatibility of deployment {matrix['deployment']}: generation (rows) <- context "
        "(columns)",
        size=14,
        weight="bold",
    )
    labels = [_cell_label(p, numbers.get((p["generation"], p["context"]))) for p in refused]
    cell_width = max(120, *(len(text) * CHAR_WIDTH + 16 for text in labels))
    row_label = max([20, *(len(g["instance"]) + 12 for g in generations)]) * CHAR_WIDTH
    left, y = 10 + row_label, 24 + LINE + 8
    for column, context in enumerate(contexts):
        x = left + column * cell_width + cell_width / 2
        canvas.text(x, y, context["instance"], anchor="middle", weight="bold")
        canvas.text(x, y + LINE - 4, _ranks(context), size=11, anchor="middle")
    y += LINE + 6
    pairs = {(p["generation"], p["context"]): p for p in matrix["pairs"]}
    for generation in generations:
        _row(canvas, generation, contexts, pairs, numbers, (left, y, cell_width))
        y += CELL_HEIGHT
    if not contexts or not generations:
        canvas.text(
            10, y + LINE, "no pair yet: the deployment needs a context and a generation instance"
        )
        y += LINE
    y += LINE + 6
    for number, pair in enumerate(refused, start=1):
        canvas.text(10, y, f"[{number}] {_explanation(pair)}", size=12)
        y += LINE
    return canvas.render()


def _row(
    canvas: Canvas,
    generation: dict[str, Any],
    contexts: list[dict[str, Any]],
    pairs: dict[tuple[str, str], dict[str, Any]],
    numbers: dict[tuple[str, str], int],
    place: tuple[float, float, float],
) -> None:
    """One generation instance's row: its name and one cell per context instance."""
    left, y, cell_width = place
    name = generation["instance"]
    canvas.text(10, y + CELL_HEIGHT / 2, name, weight="bold")
    canvas.text(10, y + CELL_HEIGHT / 2 + 14, _ranks(generation), size=11)
    for column, context in enumerate(contexts):
        pair = pairs[(name, context["instance"])]
        number = numbers.get((name, context["instance"]))
        x = left + column * cell_width
        title = _explanation(pair) if number else f"{name} <- {context['instance']}: compatible"
        canvas.box(x, y, cell_width - 2, CELL_HEIGHT - 2, fill=FILLS[pair["status"]], title=title)
        canvas.text(
            x + cell_width / 2, y + CELL_HEIGHT / 2 + 4, _cell_label(pair, number), anchor="middle"
        )
