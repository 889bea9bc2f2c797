"""The HTML report shows what is missing: a gap for a missing layer, a marked cell for a missing expert, causes.

Rendered by a real headless Chromium (required in CI, see scripts/test.sh): the DOM it builds and a screenshot
whose pixels are read back.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import zlib

import pytest
from conftest import FIXTURES, load_output
from test_audit import MOE, reference, write_hf
from ckpttool.audit.report_charts import COLOURS, shade, text_on
from test_audit_cli import CHROMIUM, HEADLESS

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("CKPTTOOL_REQUIRE_CHROMIUM") != "1",
    reason="no chromium on PATH (scripts/test.sh, which CI runs, installs it and requires this test)",
)


VPP = FIXTURES / "megatron_pp2_vpp2"


def llama_without_layer_2(tmp_path):
    """The 4-layer Llama of the Megatron VPP fixture, its layer 2 gone (a pipeline chunk not merged)."""
    tensors = load_output(VPP / "reference")
    config = json.loads((VPP / "config.json").read_text())
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        del tensors[name]
    return write_hf(tmp_path / "llama", tensors, config)


def mixtral_without_expert_3_of_layer_0(tmp_path):
    tensors, config = reference("mixtral_fsdp2_dcp")
    for w in ("w1", "w2", "w3"):
        del tensors[MOE.format(layer=0, expert=3, w=w)]
    return write_hf(tmp_path / "mixtral", tensors, config)


def render(cli, tmp_path, src, name: str) -> tuple[str, list[list[tuple[int, int, int]]]]:
    """The DOM Chromium builds from the audit's page, and the screenshot's pixels."""
    assert CHROMIUM is not None, "CKPTTOOL_REQUIRE_CHROMIUM=1 but no chromium on PATH"
    page = tmp_path / f"{name}.html"
    cli("audit", src, "--html", page)
    browser = [CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    shot = tmp_path / f"{name}.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    return dom, read_png(shot.read_bytes())


def read_png(png: bytes) -> list[list[tuple[int, int, int]]]:
    """Rows of RGB pixels of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, data, header = 8, b"", None
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            data += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    channels = 3 if colour == 2 else 4
    raw, stride, rows, previous = zlib.decompress(data), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([tuple(line[x * channels:x * channels + 3]) for x in range(width)])
        previous = line
    return rows


def missing_marks(pixels) -> int:
    """Pixels in the light red of a missing layer's band and a missing expert's hatching."""
    return sum(1 for row in pixels for r, g, b in row if r >= 235 and 190 <= g <= 222 and abs(g - b) <= 6 and r - g >= 20)


@needs_chromium
def test_a_missing_layer_is_a_marked_gap_on_the_full_axis(cli, tmp_path):
    clean_dom, clean = render(cli, tmp_path, write_hf(tmp_path / "whole", load_output(VPP / "reference"),
                                                           json.loads((VPP / "config.json").read_text())), "clean")
    dom, pixels = render(cli, tmp_path, llama_without_layer_2(tmp_path), "gap")
    charts = re.findall(r'<div class="chart">.*?</svg></div>', dom)
    assert len(charts) == 9  # 2 norms, q, k, v, o, gate, up, down
    for chart in charts:
        assert chart.count('<g class="missing-layer" data-layer="2">') == 1
        assert ">3</text>" in chart and ">layer</text>" in chart and ">RMS</text>" in chart  # the axis reaches layer 3
        assert chart.count("<polyline") == 2  # the line stops before the gap and starts again after it
        assert chart.count("<circle") == 3
    assert "missing-layer" not in clean_dom
    assert "layers 2 of 'model.layers' are missing entirely" in dom
    assert missing_marks(pixels) > 9 * 100 and missing_marks(clean) < 50  # the red bands are drawn


@needs_chromium
def test_a_missing_expert_has_its_cell_marked(cli, tmp_path):
    dom, pixels = render(cli, tmp_path, mixtral_without_expert_3_of_layer_0(tmp_path), "expert")
    tables = re.findall(r'<table class="heat">.*?</table>', dom)
    assert len(tables) == 3  # w1, w2, w3
    for table in tables:
        assert table.count("<tr>") == 3 and table.count("<th>") == 1 + 4 + 2  # header, layers 0-1; experts 0-3
        missing = re.findall(r'<td class="missing" data-layer="(\d+)" data-expert="(\d+)"[^>]*>missing</td>', table)
        assert missing == [("0", "3")]
    assert '<tr class="cause error">' in dom and "expert-missing" in dom
    assert missing_marks(pixels) > 3 * 100  # the hatching is drawn


@needs_chromium
def test_grouped_findings_are_one_row_each_with_their_tensors(cli, tmp_path, copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()
    dom, _ = render(cli, tmp_path, src, "coverage")
    assert dom.count('<tr class="cause error">') == 1 and dom.count('<tr class="finding error">') == 21
    assert "file '__1_0.distcp' is missing: 21 tensors uncovered" in dom


def contrast(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """WCAG 2 contrast ratio of two sRGB colours (components 0..1)."""
    def luminance(rgb):
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def hex_rgb(colour: str) -> tuple[float, float, float]:
    digits = colour[1:] if len(colour) == 7 else "".join(c * 2 for c in colour[1:])  # #rrggbb or #rgb
    return tuple(int(digits[i:i + 2], 16) / 255 for i in (0, 2, 4))


def hsl_rgb(colour: str) -> tuple[float, float, float]:
    import colorsys

    h, s, lightness = (float(v) for v in re.findall(r"[\d.]+", colour))
    return colorsys.hls_to_rgb(h / 360, lightness / 100, s / 100)


def test_text_on_every_colour_the_page_uses_is_readable():
    white = (1.0, 1.0, 1.0)
    for colour in COLOURS.values():  # white text on severity badges
        assert contrast(hex_rgb(colour), white) >= 4.5, colour
    for step in range(101):  # a heat cell's text on its shade, from the lightest to the darkest
        fraction = step / 100
        assert contrast(hsl_rgb(shade(fraction)), hex_rgb(text_on(fraction))) >= 4.5, fraction
