"""A minimal SVG canvas: text, boxes and a running size, with every string escaped.

Pictures are built top to bottom: each drawing call may grow the canvas, so a caller never
computes the final width or height up front. Monospace text is measured at a fixed advance
per character, which is what the pictures use for layout.
"""

from __future__ import annotations

from html import escape

CHAR_WIDTH = 8.5  # px per character of 13 px monospace, generous so text never overflows
LINE = 18  # px between text lines
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d37295",
    "#8cd17d",
    "#b6992d",
    "#499894",
    "#f1ce63",
)


def colour(rank: int) -> str:
    """The fill of sender rank ``rank``: the same in every picture and legend."""
    return PALETTE[rank % len(PALETTE)]


class Canvas:
    """Collects elements and the extent they need; ``render`` closes the document."""

    def __init__(self, *, margin: int = 10) -> None:
        self.margin = margin
        self.width = 0.0
        self.height = 0.0
        self._parts: list[str] = []

    def _extend(self, right: float, bottom: float) -> None:
        self.width = max(self.width, right + self.margin)
        self.height = max(self.height, bottom + self.margin)

    def text(
        self,
        x: float,
        y: float,
        content: str,
        *,
        size: int = 13,
        anchor: str = "start",
        weight: str = "normal",
        fill: str = "#000",
    ) -> None:
        """``y`` is the baseline; the canvas grows to hold the text."""
        span = len(content) * CHAR_WIDTH * size / 13
        left = x - span / 2 if anchor == "middle" else x
        self._extend(left + span, y + 4)
        self._parts.append(
            f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}">{escape(content)}</text>'
        )

    def box(
        self,
        x: float,
        y: float,
        width: float,
        height: float,
        *,
        fill: str,
        title: str | None = None,
        stroke: str = "#333",
    ) -> None:
        """A rectangle; ``title`` is its tooltip (and what tests and screen readers read)."""
        self._extend(x + width, y + height)
        tip = f"<title>{escape(title)}</title>" if title is not None else ""
        self._parts.append(
            f'<rect x="{x:g}" y="{y:g}" width="{width:g}" height="{height:g}" '
            f'fill="{fill}" stroke="{stroke}">{tip}</rect>'
        )

    def render(self) -> str:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:g}" '
            f'height="{self.height:g}" font-family="monospace">'
            f'<rect width="100%" height="100%" fill="#fafafa"/>{"".join(self._parts)}</svg>\n'
        )
