"""The audit as one self-contained HTML page: findings first, then per-layer and per-expert pictures.

No scripts, no external files: inline CSS and SVG only, so the page opens anywhere (a CI artifact, an
air-gapped machine). A broken layer shows as a red point off the line of its siblings; a dead or copied
expert as a dark or outlined cell in its layer's row.
"""

from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from ..findings import ERROR, INFO, WARNING, Finding, Report, TensorStats
from .shapes import EXPERT_NAME, LAYER_NAME

_COLOURS = {ERROR: "#c62828", WARNING: "#ef8f00", INFO: "#1565c0"}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
.verdict { display: inline-block; padding: .2em .8em; border-radius: 4px; color: #fff; font-weight: 700; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
table { border-collapse: collapse; width: 100%; margin: .5em 0; }
th, td { border-bottom: 1px solid #eee; padding: .3em .5em; text-align: left; vertical-align: top; }
th { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; }
td:nth-child(2) code { white-space: nowrap; }
.sev { color: #fff; border-radius: 3px; padding: 0 .4em; font-size: 12px; font-weight: 600; }
.meta td { border: none; padding: .1em .8em .1em 0; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { border: 1px solid #eee; border-radius: 4px; padding: .4em; }
.chart .title { font-size: 12px; font-family: monospace; }
table.heat { width: auto; }
.heat td { text-align: center; font-size: 11px; min-width: 3.5em; border: 1px solid #fff; }
.heat td.flag { outline: 3px solid #c62828; outline-offset: -3px; }
"""


def render(report: Report) -> str:
    """The report as a complete HTML document."""
    flagged: dict[str, str] = {}
    for f in report.findings:
        if f.tensor and f.severity in (ERROR, WARNING) and flagged.get(f.tensor) != ERROR:
            flagged[f.tensor] = f.severity
    summary = report.summary()
    verdict = "pass" if report.ok else "fail"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ckpttool audit: {_e(report.source)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>ckpttool audit</h1><p><span class=\"verdict {verdict}\" id=\"verdict\">{verdict.upper()}"
        f"{' WITH WARNINGS' if report.ok and summary['warnings'] else ''}</span> "
        f"{summary['errors']} errors, {summary['warnings']} warnings, {summary['info']} info</p>",
        '<table class="meta">',
        *(f"<tr><td>{_e(k)}</td><td><code>{_e(v)}</code></td></tr>" for k, v in (
            ("source", report.source), ("format", report.format), ("config", report.config or "(none)"),
            ("architecture", report.model_type or "(not checked)"), ("tensors", report.tensors),
            ("data checked", "yes" if report.data_checked else "no (headers and metadata only)"),
        )),
        "</table>",
        _findings(report.findings),
    ]
    if report.stats:
        parts.append(_layers(report.stats, flagged))
        parts.append(_experts(report.stats, flagged))
        parts.append(_all_tensors(report.stats, flagged))
    parts.append("</body></html>")
    return "\n".join(parts)


def _findings(findings: Sequence[Finding]) -> str:
    if not findings:
        return '<h2>Findings</h2><p id="findings">No findings.</p>'
    rows = "".join(
        f'<tr class="finding {f.severity}"><td><span class="sev" style="background:{_COLOURS[f.severity]}">'
        f"{f.severity}</span></td><td><code>{_e(f.code)}</code></td><td><code>{_e(f.tensor or '')}</code></td>"
        f"<td><code>{_e(f.file or '')}</code></td><td>{_e(f.message)}</td></tr>"
        for f in findings
    )
    return (f'<h2>Findings</h2><table id="findings"><tr><th>severity</th><th>code</th><th>tensor</th><th>file</th>'
            f"<th>message</th></tr>{rows}</table>")


def _layers(stats: Sequence[TensorStats], flagged: Mapping[str, str]) -> str:
    """One small chart per tensor kind: RMS against layer index."""
    groups: dict[str, list[tuple[int, TensorStats]]] = defaultdict(list)
    for s in stats:
        match = LAYER_NAME.match(s.name)
        if match and not EXPERT_NAME.match(s.name) and s.rms is not None:
            groups[f"{match['prefix']}.{{L}}.{match['rest']}"].append((int(match["index"]), s))
    if not groups:
        return ""
    charts = "".join(_chart(pattern, sorted(points, key=lambda p: p[0]), flagged) for pattern, points in groups.items())
    return f'<h2>Per layer: RMS of each tensor</h2><div class="charts" id="layers">{charts}</div>'


def _chart(pattern: str, points: Sequence[tuple[int, TensorStats]], flagged: Mapping[str, str]) -> str:
    width, height, pad = 260, 120, 28
    values = [s.rms or 0.0 for _, s in points]
    top = max(values) * 1.1 or 1.0
    layers = [i for i, _ in points]
    lo, hi = min(layers), max(layers)

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad + (width - pad - 8) * ((i - lo) / (hi - lo) if hi > lo else 0.5)
        return x, height - pad + 8 - (height - pad) * v / top

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in zip(layers, values)))
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{5 if s.name in flagged else 2.5}" '
        f'fill="{_COLOURS[flagged[s.name]] if s.name in flagged else "#455a64"}"><title>{_e(s.name)}: RMS {_num(s.rms)}</title></circle>'
        for (i, s), (x, y) in ((p, xy(p[0], p[1].rms or 0.0)) for p in points)
    )
    axes = (
        f'<line x1="{pad}" y1="{height - pad + 8}" x2="{width - 8}" y2="{height - pad + 8}" stroke="#bbb"/>'
        f'<text x="{pad}" y="{height - 4}" font-size="10">layer {lo}</text>'
        f'<text x="{width - 8}" y="{height - 4}" font-size="10" text-anchor="end">{hi}</text>'
        f'<text x="2" y="12" font-size="10">{_num(top / 1.1)}</text>'
    )
    return (f'<div class="chart"><div class="title">{_e(pattern)}</div><svg width="{width}" height="{height}" '
            f'role="img">{axes}<polyline points="{line}" fill="none" stroke="#90a4ae"/>{dots}</svg></div>')


def _experts(stats: Sequence[TensorStats], flagged: Mapping[str, str]) -> str:
    """One heat table per expert tensor kind: layers down, experts across, cells shaded by RMS."""
    grids: dict[str, dict[int, dict[int, TensorStats]]] = defaultdict(lambda: defaultdict(dict))
    for s in stats:
        expert, layer = EXPERT_NAME.match(s.name), LAYER_NAME.match(s.name)
        if expert and layer:
            kind = re.sub(r"\.\d+\.", ".{L}.", f"{expert['prefix']}.{{E}}.{expert['rest']}", count=1)
            grids[kind][int(layer["index"])][int(expert["index"])] = s
    if not grids:
        return ""
    out = ['<h2>Per expert: RMS by layer and expert</h2><div id="experts">']
    for kind, rows in grids.items():
        experts = sorted({e for row in rows.values() for e in row})
        top = max((s.rms or 0.0) for row in rows.values() for s in row.values()) or 1.0
        out.append(f'<p><code>{_e(kind)}</code></p><table class="heat"><tr><th>layer</th>'
                   + "".join(f"<th>{e}</th>" for e in experts) + "</tr>")
        for layer in sorted(rows):
            cells = []
            for e in experts:
                s = rows[layer].get(e)
                if s is None:
                    cells.append('<td class="flag" style="background:#eee">missing</td>')
                    continue
                shade = (s.rms or 0.0) / top
                colour = f"hsl(205, 70%, {95 - 55 * shade:.0f}%)" if s.rms else "#212121;color:#fff"
                mark = ' class="flag"' if s.name in flagged else ""
                cells.append(f'<td{mark} style="background:{colour}" title="{_e(s.name)}">{_num(s.rms or 0.0)}</td>')
            out.append(f"<tr><th>{layer}</th>{''.join(cells)}</tr>")
        out.append("</table>")
    out.append("</div>")
    return "".join(out)


def _all_tensors(stats: Sequence[TensorStats], flagged: Mapping[str, str]) -> str:
    rows = "".join(
        f"<tr><td><code>{_e(s.name)}</code>{' ⚠' if s.name in flagged else ''}</td><td>{_e(s.dtype)}</td>"
        f"<td>{_e('x'.join(map(str, s.shape)) or 'scalar')}</td><td class=\"num\">{_num(s.rms)}</td>"
        f"<td class=\"num\">{_num(s.mean)}</td><td class=\"num\">{_num(s.min)}</td><td class=\"num\">{_num(s.max)}</td>"
        f"<td class=\"num\">{s.nan}</td><td class=\"num\">{s.inf}</td><td><code>{s.fingerprint[:16]}</code></td></tr>"
        for s in stats
    )
    return (f"<h2>Every tensor</h2><details><summary>{len(stats)} tensors</summary><table id=\"tensors\"><tr><th>name</th>"
            "<th>dtype</th><th>shape</th><th>RMS</th><th>mean</th><th>min</th><th>max</th><th>NaN</th><th>Inf</th>"
            f"<th>fingerprint</th></tr>{rows}</table></details>")


def _num(value: float | None) -> str:
    if value is None:
        return ""
    if value == 0 or math.isfinite(value) and 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
