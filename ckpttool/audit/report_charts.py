"""The HTML report's pictures: per-layer RMS charts and per-expert heat tables, drawn over what the config declares.

Each chart's axis spans every layer the architecture declares for that tensor, not only the layers present: a
missing layer is a gap in the line with a red band and a "missing" mark at its place, never a shorter axis.
Each heat table has a row for every declared layer and a cell for every declared expert; a missing expert is a
hatched cell saying "missing". Axes carry their scale (RMS ticks, layer ticks) and the shading has a legend.
"""

from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ckpttool.findings import ERROR, INFO, WARNING, TensorStats
from ckpttool.audit.shapes import EXPERT_NAME, LAYER_NAME

#: severity colours, dark enough for white text (contrast 4.5:1 or more)
COLOURS = {ERROR: "#c62828", WARNING: "#b45f00", INFO: "#1565c0"}
_POINT = "#37474f"
_LINE = "#78909c"

CSS = """
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { border: 1px solid #ddd; border-radius: 4px; padding: .4em; }
.chart .title { font-size: 12px; font-family: monospace; }
.chart text { fill: #333; font-size: 10px; }
table.heat { width: auto; }
.heat td { text-align: center; font-size: 11px; min-width: 3.5em; border: 1px solid #fff; }
.heat td.flag { outline: 3px solid #c62828; outline-offset: -3px; }
.heat td.missing { background: repeating-linear-gradient(45deg, #fff, #fff 4px, #f3d6d6 4px, #f3d6d6 8px);
  color: #8e0000; font-weight: 600; outline: 2px dashed #c62828; outline-offset: -2px; }
.legend { font-size: 12px; color: #333; margin: .3em 0 1em; }
.legend span { display: inline-block; width: 1.6em; height: 1em; vertical-align: middle; border: 1px solid #ccc; }
"""


def layer_charts(stats: Sequence[TensorStats], expected: Iterable[str], flagged: Mapping[str, str]) -> str:
    """One chart per non-expert tensor kind of the layers: RMS against layer index, over the declared layers."""
    present: dict[str, dict[int, TensorStats]] = defaultdict(dict)
    for s in stats:
        match = LAYER_NAME.match(s.name)
        if match and not EXPERT_NAME.match(s.name) and s.rms is not None:
            present[_pattern(match)][int(match["index"])] = s
    declared: dict[str, set[int]] = defaultdict(set)
    for name in expected:
        match = LAYER_NAME.match(name)
        if match and not EXPERT_NAME.match(name):
            declared[_pattern(match)].add(int(match["index"]))
    patterns = list(present) + [p for p in declared if p not in present]
    if not patterns:
        return ""
    charts = "".join(_chart(p, present.get(p, {}), declared.get(p, set()), flagged) for p in patterns)
    return f'<h2>Per layer: RMS of each tensor</h2><div class="charts" id="layers">{charts}</div>'


def expert_tables(stats: Sequence[TensorStats], expected: Iterable[str], flagged: Mapping[str, str]) -> str:
    """One heat table per expert tensor kind: a row per declared layer, a cell per declared expert."""
    grids: dict[str, dict[int, dict[int, TensorStats]]] = defaultdict(lambda: defaultdict(dict))
    declared: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for s in stats:
        key = _expert_key(s.name)
        if key:
            grids[key[0]][key[1]][key[2]] = s
    for name in expected:
        key = _expert_key(name)
        if key:
            declared[key[0]].add((key[1], key[2]))
    kinds = list(grids) + [k for k in declared if k not in grids]
    if not kinds:
        return ""
    out = ['<h2>Per expert: RMS by layer and expert</h2><div id="experts">']
    for kind in kinds:
        rows = grids.get(kind, {})
        cells = declared.get(kind, set())
        layers = sorted(set(rows) | {layer for layer, _ in cells})
        experts = sorted({e for row in rows.values() for e in row} | {e for _, e in cells})
        top = max(((s.rms or 0.0) for row in rows.values() for s in row.values()), default=0.0) or 1.0
        out.append(f'<p><code>{escape(kind)}</code></p><div class="legend">RMS: <span style="background:{shade(0)}">'
                   f'</span> 0 … <span style="background:{shade(1)}"></span> {number(top)}; '
                   '<span style="background:#212121"></span> all zeros; hatched: missing</div>'
                   '<table class="heat"><tr><th>layer \\ expert</th>' + "".join(f"<th>{e}</th>" for e in experts) + "</tr>")
        for layer in layers:
            row = []
            for e in experts:
                s = rows.get(layer, {}).get(e)
                name = kind.replace("{L}", str(layer)).replace("{E}", str(e))
                if s is None:
                    row.append(f'<td class="missing" data-layer="{layer}" data-expert="{e}" title="{escape(name)} is missing">'
                               "missing</td>")
                    continue
                fraction = (s.rms or 0.0) / top
                colour = f"{shade(fraction)};color:{text_on(fraction)}" if s.rms else "#212121;color:#fff"
                mark = ' class="flag"' if s.name in flagged else ""
                row.append(f'<td{mark} style="background:{colour}" title="{escape(s.name)}">{number(s.rms or 0.0)}</td>')
            out.append(f"<tr><th>{layer}</th>{''.join(row)}</tr>")
        out.append("</table>")
    out.append("</div>")
    return "".join(out)


def _chart(pattern: str, points: Mapping[int, TensorStats], declared: set[int], flagged: Mapping[str, str]) -> str:
    width, height, left, right, top_pad, bottom = 316, 150, 64, 10, 10, 34
    layers = sorted(set(points) | declared)
    lo, hi = layers[0], layers[-1]
    top = max((s.rms or 0.0) for s in points.values()) * 1.1 if points else 1.0
    top = top or 1.0
    base = height - bottom

    def x(i: int) -> float:
        return left + (width - left - right) * ((i - lo) / (hi - lo) if hi > lo else 0.5)

    def y(v: float) -> float:
        return base - (base - top_pad) * v / top

    ticks_y = "".join(
        f'<line x1="{left - 4}" y1="{y(v):.1f}" x2="{left}" y2="{y(v):.1f}" stroke="#666"/>'
        f'<text x="{left - 6}" y="{y(v) + 3:.1f}" text-anchor="end">{number(v)}</text>'
        for v in (0.0, top / 2.2, top / 1.1)
    )
    ticks_x = "".join(
        f'<line x1="{x(i):.1f}" y1="{base}" x2="{x(i):.1f}" y2="{base + 4}" stroke="#666"/>'
        f'<text x="{x(i):.1f}" y="{base + 14}" text-anchor="middle">{i}</text>'
        for i in _layer_ticks(lo, hi)
    )
    axes = (
        f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{base}" stroke="#666"/>'
        f'<line x1="{left}" y1="{base}" x2="{width - right}" y2="{base}" stroke="#666"/>{ticks_y}{ticks_x}'
        f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" text-anchor="middle">layer</text>'
        f'<text x="9" y="{(top_pad + base) / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 9 {(top_pad + base) / 2:.0f})">RMS</text>'
    )
    gaps = "".join(
        f'<g class="missing-layer" data-layer="{i}"><title>layer {i}: {escape(pattern.replace("{L}", str(i)))} is missing'
        f'</title><rect x="{x(i) - 3:.1f}" y="{top_pad}" width="6" height="{base - top_pad}" fill="#c62828" '
        f'fill-opacity="0.25"/><text x="{x(i):.1f}" y="{top_pad + 10}" text-anchor="middle" fill="#8e0000" '
        'font-weight="700">×</text></g>'
        for i in layers if i not in points
    )
    lines = "".join(
        f'<polyline points="{" ".join(f"{x(i):.1f},{y(points[i].rms or 0.0):.1f}" for i in run)}" fill="none" '
        f'stroke="{_LINE}"/>'
        for run in _runs(layers, points)
    )
    dots = "".join(
        f'<circle cx="{x(i):.1f}" cy="{y(s.rms or 0.0):.1f}" r="{5 if s.name in flagged else 2.5}" '
        f'fill="{COLOURS.get(flagged.get(s.name, ""), _POINT)}"><title>{escape(s.name)}: RMS {number(s.rms)}</title></circle>'
        for i, s in sorted(points.items())
    )
    return (f'<div class="chart"><div class="title">{escape(pattern)}</div><svg width="{width}" height="{height}" '
            f'role="img" aria-label="{escape(pattern)}">{axes}{gaps}{lines}{dots}</svg></div>')


def _runs(layers: Sequence[int], points: Mapping[int, TensorStats]) -> list[list[int]]:
    """The present layers cut at every missing one: the line never bridges a gap."""
    runs: list[list[int]] = [[]]
    for i in layers:
        if i in points:
            runs[-1].append(i)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _layer_ticks(lo: int, hi: int) -> list[int]:
    step = max(1, math.ceil((hi - lo) / 6))
    ticks = list(range(lo, hi + 1, step))
    if ticks[-1] != hi:
        if hi - ticks[-1] < step / 2 and len(ticks) > 1:
            ticks[-1] = hi
        else:
            ticks.append(hi)
    return ticks


def _pattern(match: re.Match[str]) -> str:
    return f"{match['prefix']}.{{L}}.{match['rest']}"


def _expert_key(name: str) -> tuple[str, int, int] | None:
    expert, layer = EXPERT_NAME.match(name), LAYER_NAME.match(name)
    if not (expert and layer):
        return None
    kind = re.sub(r"\.\d+\.", ".{L}.", f"{expert['prefix']}.{{E}}.{expert['rest']}", count=1)
    return kind, int(layer["index"]), int(expert["index"])


def shade(fraction: float) -> str:
    """A heat cell's background for an RMS ``fraction`` of the table's largest: light to dark blue."""
    return f"hsl(205, 70%, {_lightness(fraction)}%)"


def text_on(fraction: float) -> str:
    """Text readable on :func:`shade` (WCAG contrast 4.5:1 or more): black on the light shades, white on the dark."""
    return "#000" if _lightness(fraction) >= 44 else "#fff"


def _lightness(fraction: float) -> int:
    return round(95 - 65 * fraction)


def number(value: float | None) -> str:
    if value is None:
        return ""
    if value == 0 or math.isfinite(value) and 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def escape(value: object) -> str:
    """``value`` as HTML text; a lone surrogate (a name decoded with ``surrogateescape``, or a ``\\udc80`` in a
    safetensors header) becomes the visible text ``\\udc80``, since a UTF-8 page cannot hold it."""
    return html.escape(str(value).encode("utf-8", "backslashreplace").decode("utf-8"), quote=True)
