"""The audit as one self-contained HTML page: the causes first, each with its findings, then the pictures.

No scripts, no external files: inline CSS and SVG only, so the page opens anywhere (a CI artifact, an
air-gapped machine). Each cause is a row with its tensors' findings folded under it (at most
:data:`FINDINGS_PER_CAUSE`, the JSON has them all). A broken layer shows as a red point off the line of its
siblings, a missing one as a marked gap; a dead or copied expert as a dark or outlined cell in its layer's row, a
missing one as a hatched cell (:mod:`.report_charts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpttool.console.words import counted
from ckpttool.findings import ERROR, WARNING, Cause, Report, TensorStats
from ckpttool.audit.causes import group_findings
from ckpttool.audit.report_charts import COLOURS, CSS, escape, expert_tables, layer_charts, number

#: findings listed under a cause on the page; the JSON report lists every one
FINDINGS_PER_CAUSE = 200

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
tr.cause > td { border-top: 2px solid #ddd; }
details.members table { margin: .2em 0 .4em; } details.members summary { cursor: pointer; color: #0d47a1; }
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
        f"<title>ckpttool audit: {escape(report.source)}</title>",
        f"<style>{_CSS}{CSS}</style></head><body>",
        f"<h1>ckpttool audit</h1><p><span class=\"verdict {verdict}\" id=\"verdict\">{verdict.upper()}"
        f"{' WITH WARNINGS' if report.ok and summary['warnings'] else ''}</span> "
        f"{report.counts()}</p>",
        '<table class="meta">',
        *(f"<tr><td>{escape(k)}</td><td><code>{escape(v)}</code></td></tr>" for k, v in (
            ("source", report.source), ("format", report.format), ("config", report.config or "(none)"),
            ("architecture", report.model_type or "(not checked)"), ("tensors", report.tensors),
            ("data checked", "yes" if report.data_checked else "no (headers and metadata only)"),
        )),
        "</table>",
        _causes(report.causes or group_findings(report.findings)),
    ]
    if report.stats:
        parts.append(layer_charts(report.stats, report.expected, flagged))
        parts.append(expert_tables(report.stats, report.expected, flagged))
        parts.append(_all_tensors(report.stats, flagged))
    parts.append("</body></html>")
    return "\n".join(parts)


def _causes(causes: Sequence[Cause]) -> str:
    if not causes:
        return '<h2>Findings</h2><p id="findings">No findings.</p>'
    rows = []
    for c in causes:
        shown = c.findings[:FINDINGS_PER_CAUSE]
        more = len(c.findings) - len(shown)
        members = "".join(
            f'<tr class="finding {f.severity}"><td><code>{escape(f.tensor or "")}</code></td>'
            f'<td><code>{escape(f.file or "")}</code></td><td>{escape(f.message)}</td></tr>'
            for f in shown
        ) + (f'<tr><td colspan="3">… and {more} more (the JSON report lists them all)</td></tr>' if more else "")
        rows.append(
            f'<tr class="cause {c.severity}"><td><span class="sev" style="background:{COLOURS[c.severity]}">'
            f"{c.severity}</span></td><td><code>{escape(c.code)}</code></td><td class=\"num\">{c.count}</td>"
            f"<td>{escape(c.cause)}<details class=\"members\"{' open' if 1 < len(c.findings) <= 3 else ''}><summary>"
            f"{counted(len(c.findings), 'finding')}</summary><table><tr><th>tensor</th>"
            f"<th>file</th><th>message</th></tr>{members}</table></details></td></tr>"
        )
    return (f'<h2>Findings, by cause</h2><table id="findings"><tr><th>severity</th><th>code</th><th>tensors</th>'
            f"<th>cause</th></tr>{''.join(rows)}</table>")


def _all_tensors(stats: Sequence[TensorStats], flagged: Mapping[str, str]) -> str:
    rows = "".join(
        f"<tr><td><code>{escape(s.name)}</code>{' ⚠' if s.name in flagged else ''}</td><td>{escape(s.dtype)}</td>"
        f"<td>{escape('x'.join(map(str, s.shape)) or 'scalar')}</td><td class=\"num\">{number(s.rms)}</td>"
        f"<td class=\"num\">{number(s.mean)}</td><td class=\"num\">{number(s.min)}</td><td class=\"num\">{number(s.max)}</td>"
        f"<td class=\"num\">{s.nan}</td><td class=\"num\">{s.inf}</td><td><code>{s.fingerprint[:16]}</code></td></tr>"
        for s in stats
    )
    return (f"<h2>Every tensor</h2><details><summary>{counted(len(stats), 'tensor')}</summary><table id=\"tensors\"><tr><th>name</th>"
            "<th>dtype</th><th>shape</th><th>RMS</th><th>mean</th><th>min</th><th>max</th><th>NaN</th><th>Inf</th>"
            f"<th>fingerprint</th></tr>{rows}</table></details>")
