"""Charts drawn as SVG pages (nothing fetched; a script only to follow links): parallel coordinates, importance."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from frontend.palette import GAIN_BETTER as POS
from frontend.palette import GAIN_WORSE as NEG
from frontend.palette import GAIN_ZERO as MID
from frontend.tree_explorer import FOLLOW_LINKS


def _mix(a: str, b: str, t: float) -> str:
    pa = [int(a[i : i + 2], 16) for i in (1, 3, 5)]
    pb = [int(b[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(pa, pb, strict=True))


def gain_colour(gain: float | None, spread: float) -> str:
    """Return a gain's colour on the diverging scale (red below 0, white at 0, blue above)."""
    if gain is None or spread <= 0:
        return "#9e9e9e"
    t = max(-1.0, min(1.0, gain / spread))
    return _mix(MID, POS, t) if t >= 0 else _mix(MID, NEG, -t)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _page(body: str, title: str) -> str:
    return (
        '<!doctype html><html><head><meta charset="utf-8"><style>'
        'body{margin:0;font-family:"Source Sans Pro",Helvetica,Arial,sans-serif;font-size:12px;color:#262730}'
        "polyline{fill:none;stroke-width:1.6;opacity:.75}a:hover polyline{stroke-width:4;opacity:1}"
        "text{fill:#31333f}.axis{stroke:#8a8a99;stroke-width:1}.muted{fill:#6b6b7b;color:#6b6b7b}p{margin:2px 0 0 60px}"
        f'</style></head><body><div role="img" aria-label="{escape(title)}">{body}</div>'
        f"<script>{FOLLOW_LINKS}</script></body></html>"
    )


class _Axis:
    """One vertical axis: numbers on a linear or log scale, anything else evenly spaced."""

    def __init__(self, values: list[Any]) -> None:
        present = [v for v in values if v is not None]
        self.numeric = bool(present) and all(_number(v) for v in present)
        if self.numeric:
            lo, hi = min(present), max(present)
            self.log = lo > 0 and hi / lo >= 100
            self.lo, self.hi = (math.log10(lo), math.log10(hi)) if self.log else (float(lo), float(hi))
            self.ticks = [lo, hi] if lo != hi else [lo]
        else:
            self.log = False
            self.ticks = sorted({str(v) for v in present})

    def place(self, v: Any) -> float | None:
        """Return where a value sits, 0 (bottom) to 1 (top)."""
        if v is None:
            return None
        if self.numeric:
            if not _number(v):
                return None
            x = math.log10(v) if self.log and v > 0 else float(v)
            return 0.5 if self.hi == self.lo else (x - self.lo) / (self.hi - self.lo)
        s = str(v)
        if s not in self.ticks:
            return None
        return 0.5 if len(self.ticks) == 1 else self.ticks.index(s) / (len(self.ticks) - 1)


def parallel(
    points: list[dict[str, Any]],
    keys: list[str],
    metric: str,
    baseline: float | None,
    maximize: bool,
    url: str,
) -> str:
    """Return parallel coordinates of the searched values and the dev score, each line coloured by dev gain."""
    keys = [k for k in keys if any(p["values"].get(k) is not None for p in points)][:12]
    axes = [(k, _Axis([p["values"].get(k) for p in points])) for k in keys]
    axes.append((f"dev {metric}", _Axis([p["dev"] for p in points])))
    sign = 1.0 if maximize else -1.0
    gains = [sign * (p["dev"] - baseline) if baseline is not None else None for p in points]
    spread = max((abs(g) for g in gains if g is not None), default=0.0)
    width, top, height = max(640, 150 * len(axes)), 40, 240
    step = (width - 120) / max(1, len(axes) - 1)
    out = [f'<svg id="parallel" width="{width}" height="{top + height + 24}">']
    lines = []
    for p, g in sorted(
        zip(points, gains, strict=True), key=lambda pg: pg[1] if pg[1] is not None else -math.inf
    ):
        coords = []
        for i, (name, ax) in enumerate(axes):
            v = p["dev"] if i == len(axes) - 1 else p["values"].get(name)
            y = ax.place(v)
            if y is not None:
                coords.append(f"{60 + i * step:.1f},{top + (1 - y) * height:.1f}")
        tip = f"n{p['node_number']} · {p['status']} · dev {p['dev']:.4g}" + (
            f" · dev gain {g:+.4g}" if g is not None else ""
        )
        lines.append(
            f'<a href="{escape(url + str(p["node_id"]))}" target="_top" data-node="{p["node_number"]}">'
            f'<polyline points="{" ".join(coords)}" stroke="{gain_colour(g, spread)}"><title>{escape(tip)}</title>'
            "</polyline></a>"
        )
    out += lines
    for i, (name, ax) in enumerate(axes):
        x = 60 + i * step
        out.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + height}"/>')
        out.append(
            f'<text x="{x:.1f}" y="{top - 14}" text-anchor="middle" font-weight="600">{escape(name[-28:])}</text>'
        )
        ticks = ax.ticks if len(ax.ticks) <= 12 else [ax.ticks[0], ax.ticks[-1]]
        for t in ticks:
            y = ax.place(t)
            if y is None:
                continue
            label = f"{t:.4g}" if _number(t) else str(t)[:14]
            out.append(
                f'<text class="muted" x="{x + 5:.1f}" y="{top + (1 - y) * height + 4:.1f}">{escape(label)}</text>'
            )
        if ax.log:
            out.append(
                f'<text class="muted" x="{x:.1f}" y="{top + height + 16}" text-anchor="middle">log scale</text>'
            )
    out.append(
        '</svg><p class="muted">one line per measured node · colour: dev gain over the baseline (red worse, '
        "blue better) · click a line to open its node</p>"
    )
    return _page("".join(out), "parallel coordinates")


def importance(keys: list[dict[str, Any]], method: str, measured: int) -> str:
    """Return a bar per searched key: how much it sets the best measured nodes apart."""
    rows = keys[:15]
    width, bar = 640, 22
    out = [f'<svg id="importance" width="{width}" height="{len(rows) * bar + 34}">']
    for i, r in enumerate(rows):
        y = 4 + i * bar
        w = max(1.0, 300 * float(r["importance"]))
        out.append(f'<text x="230" y="{y + 14}" text-anchor="end">{escape(str(r["key"])[-34:])}</text>')
        out.append(
            f'<rect class="bar" x="238" y="{y + 3}" width="{w:.1f}" height="{bar - 7}" fill="{POS}" rx="3"/>'
        )
        out.append(
            f'<text class="muted" x="{242 + w:.1f}" y="{y + 14}">{100 * float(r["importance"]):.0f}%</text>'
        )
    out.append(
        f'<text class="muted" x="8" y="{len(rows) * bar + 24}">how much each key sets the best dev scores '
        f"apart: {escape(method)} over {measured} measured nodes</text></svg>"
    )
    return _page("".join(out), "parameter importance")
