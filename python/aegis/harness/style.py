"""The styling the audit's and the utility study's pages and figures share: one stylesheet, HTML escaping
and number cells, and the side-by-side placement of markers that would sit on top of each other."""

from __future__ import annotations

import html
import math
from typing import Any


def dodge(points: list[tuple[float, float]], log_x: bool, span: tuple[float, float]) -> list[float]:
    """Horizontal offsets (a share of the axis width; y stays exact, so no point crosses a threshold line)
    so that markers at (nearly) the same place sit side by side instead of on top of each other."""

    def pos(x: float) -> float:
        return math.log10(max(x, 1e-12)) if log_x else x

    width = max(pos(span[1]) - pos(span[0]), 1e-9)
    offsets = [0.0] * len(points)
    for i, (x, y) in enumerate(points):
        while any(
            abs(pos(x) + offsets[i] * width - pos(points[j][0]) - offsets[j] * width) < 0.025 * width
            and abs(y - points[j][1]) < 0.04
            for j in range(i)
        ):
            offsets[i] = -offsets[i] + (0.03 if offsets[i] <= 0 else 0.0)  # 0, +3 %, -3 %, +6 %, ...
    return offsets


def shift(x: float, share: float, log_x: bool, span: tuple[float, float]) -> float:
    """``x`` moved by ``share`` of the axis width (a :func:`dodge` offset), on a log axis when ``log_x``."""
    if not share:
        return x
    if log_x:
        width = math.log10(max(span[1], 1e-12)) - math.log10(max(span[0], 1e-12))
        return x * 10 ** (share * max(width, 1e-9))
    return x + share * max(span[1] - span[0], 1e-9)


# the audit page's and the utility page's styles: verdict colours, token marks, number cells
CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1250px;color:#222}
table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 7px;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.hit{background:#b7e4b0}.moved{background:#ffd59e}.miss{color:#999}.more{color:#777;font-style:italic}
.ref{color:#333}.empty{color:#aaa;font-style:italic}.na{color:#aaa}
.leak{color:#b00020;font-weight:600}.holds{color:#176d2c;font-weight:600}.suspect{color:#a15c00;font-weight:600}
.how{background:#f7f7fb;border-left:4px solid #6b6bd6;padding:.6em 1em;max-width:900px}
"""


def escape(value: Any) -> str:
    """Any value as HTML text."""
    return html.escape(str(value))


def number_cell(value: float | None, digits: int = 3) -> str:
    """A right-aligned table cell, or a grey dash for a missing number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "<td class='n na'>–</td>"
    return f"<td class='n'>{value:.{digits}f}</td>"
