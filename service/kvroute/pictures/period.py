"""A view pair's period as a picture: sender blocks above, receiver blocks below, cut between.

Drawn under a view's title when its plan states a period (the two sides cut tokens into blocks
of different sizes): one bar of sender blocks and one of receiver blocks over the period's tokens,
and between them one box per piece (the tokens one sender block and one receiver block share),
titled with the blocks and tokens it moves. With context parallelism a side's bar shows only the
prompt tokens its rank holds (each run titled with its local block), so the picture shows the
token split; one strip is drawn per sender rank that writes.
"""

from __future__ import annotations

from kvroute.geometry import ViewTransfer
from kvroute.pictures.svg import LINE, Canvas, colour
from kvroute.render import held_runs, is_cp, period_pieces

STRIP_WIDTH = 384  # px for one period of tokens
ROW = 18
LEFT = 130


def period_strip(canvas: Canvas, view: ViewTransfer, y: float) -> float:
    """Draws the strip from ``y``; returns the y below it."""
    period_map = view.period_map
    period = period_map.period_tokens
    scale = STRIP_WIDTH / period
    rows = (
        ("sender", 0, period_map.src_blocks_per_period),
        ("receiver", 2, period_map.dst_blocks_per_period),
    )
    for label, row, blocks in rows:
        top, size = y + row * ROW, period // blocks
        if is_cp(view):
            _held(canvas, view, label, top, scale)
            continue
        canvas.text(10, top + 13, f"{label} blocks", size=11)
        for block in range(blocks):
            x = LEFT + block * size * scale
            canvas.box(x, top, size * scale - 1, ROW - 2, fill="#ffffff")
            canvas.text(x + 3, top + 13, f"{label[0]}b{block}", size=11)
    canvas.text(10, y + ROW + 13, "pieces", size=11)
    for index, (src, dst, first, end) in enumerate(period_pieces(view)):
        canvas.box(
            LEFT + first * scale,
            y + ROW,
            (end - first) * scale - 1,
            ROW - 2,
            fill=colour(index),
            title=f"tokens [{first}, {end}): sender block {src} -> receiver block {dst}",
        )
    note = f"{period} tokens per period, {len(period_map.spans):,} fragments"
    canvas.text(LEFT, y + 3 * ROW + 12, note, size=11)
    return y + 3 * ROW + LINE + 8


def _held(canvas: Canvas, view: ViewTransfer, label: str, top: float, scale: float) -> None:
    """A context-parallel side's bar: the runs of prompt tokens its rank holds."""
    side = "src" if label == "sender" else "dst"
    canvas.text(10, top + 13, f"{label} holds", size=11)
    for index, (first, end) in enumerate(held_runs(view, side)):
        canvas.box(
            LEFT + first * scale,
            top,
            max((end - first) * scale - 1, 1),
            ROW - 2,
            fill=colour(index),
            title=f"{label} holds tokens [{first}, {end})",
        )
