"""The report of a compiled pipeline: self-contained HTML, figures, tables, same bytes every time."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from autopipe.errors import ArtifactError
from autopipe.report import ReportData, show_table, write_report
from autopipe.report.figures import save_figure, timeline_figure, times_figure
from autopipe.report.html import inline_svg
from autopipe.report.modelgraph import MAX_BLOCKS, MAX_ROWS, collapse_readable, columns

from conftest import ROOT, compile_model

FIGURES = ("times", "timeline", "memory", "graph")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """GPT-2 in 3 stages, one per device."""
    out = tmp_path_factory.mktemp("report") / "gpt2"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        compile_model("gpt2", out, 3)
    return out


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    """An MLP in 4 stages on 2 devices (Mixed-Pipe: a device runs two stages)."""
    out = tmp_path_factory.mktemp("report") / "mixed"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        compile_model("mlp", out, 4, devices=2)
    return out


def test_report_is_self_contained(gpt2_dir):
    page = write_report(gpt2_dir)
    assert page == gpt2_dir / "report" / "report.html"
    html = page.read_text()
    # every figure inlined as SVG, and written beside the page as SVG and PNG
    assert html.count("<svg ") == len(FIGURES)
    for name in FIGURES:
        assert (page.parent / f"{name}.svg").read_text().lstrip().startswith("<?xml")
        assert (page.parent / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    # nothing fetched, nothing run
    assert "http" not in html
    assert "<script" not in html and "<link" not in html and "src=" not in html
    # the summary and one row per stage, with the values crossing stages
    data = ReportData.load(gpt2_dir)
    assert "predicted pipeline run (before the optimizer)" in html
    assert "bottleneck vs lower bound" in html
    for row in data.stages:
        match = re.search(rf'<tr id="stage-{row.stage}"[^>]*>(.*?)</tr>', html, re.S)
        assert match, f"no row for stage {row.stage}"
        for name in row.inputs + row.outputs:
            assert name in match.group(1)


def test_inlined_ids_are_unique_and_resolve(gpt2_dir):
    html = write_report(gpt2_dir).read_text()
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids))
    refs = set(re.findall(r'(?:href="#|url\(#)([^")]+)', html))
    assert refs and refs <= set(ids)


def test_inline_svg_prefixes_ids():
    svg = (
        '<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"><metadata>x</metadata>'
        '<defs><path id="a"/><clipPath id="ab"/></defs><use xlink:href="#a"/>'
        '<g clip-path="url(#ab)"/></svg>'
    )
    assert inline_svg(svg, "f-") == (
        '<svg><defs><path id="f-a"/><clipPath id="f-ab"/></defs><use xlink:href="#f-a"/>'
        '<g clip-path="url(#f-ab)"/></svg>'
    )


def test_report_is_deterministic(gpt2_dir):
    """Writing again, in another process with another hash seed, gives the same bytes."""
    write_report(gpt2_dir)
    first = {p.name: p.read_bytes() for p in sorted((gpt2_dir / "report").iterdir())}
    code = f"from autopipe.report import write_report; write_report({str(gpt2_dir)!r})"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=300)
    second = {p.name: p.read_bytes() for p in sorted((gpt2_dir / "report").iterdir())}
    expected = [f"{name}.{ext}" for name in FIGURES for ext in ("png", "svg")] + ["report.html"]
    assert sorted(first) == sorted(expected)
    assert first == second


def test_show_table(gpt2_dir, mixed_dir):
    for directory in (gpt2_dir, mixed_dir):
        data = ReportData.load(directory)
        lines = show_table(directory).splitlines()
        assert lines[1].split()[:8] == [
            "stage", "device", "units", "params", "fwd", "ms", "bwd", "ms",
        ]  # fmt: skip
        assert len(lines) == data.num_stages + 3
        for row, line in zip(data.stages, lines[2:]):
            stage, device, units = line.split()[:3]
            assert (int(stage), int(device), int(units)) == (row.stage, row.device, row.units)
            assert ", ".join(row.inputs) in line and ", ".join(row.outputs) in line
        assert lines[-1].startswith("predicted step")


def test_mixed_pipe_figures(mixed_dir):
    """Several stages per device: a per-device panel beside the per-stage one, and the timeline
    has one row per device holding the actions of all its stages."""
    data = ReportData.load(mixed_dir)
    assert data.num_devices == 2 and data.num_stages == 4
    fig = times_figure(data)
    assert len(fig.axes) == 2
    save_figure(fig)
    fig = timeline_figure(data)
    (ax,) = fig.axes
    assert len(ax.get_yticks()) == 2
    save_figure(fig)
    stages_per_device = {
        d: {a.stage for dd, a, _, _ in data.simulation.events if dd == d} for d in (0, 1)
    }
    assert stages_per_device == {d: set(data.stages_on(d)) for d in (0, 1)}
    assert (write_report(mixed_dir).read_text()).count("<svg ") == len(FIGURES)


def test_model_graph_is_collapsed_and_ordered(gpt2_dir):
    data = ReportData.load(gpt2_dir)
    stage_of_unit = data.partition.stage_of_unit
    collapsed = collapse_readable(data.graph, stage_of_unit)
    assert len(collapsed.blocks) <= MAX_BLOCKS
    assert max(len(c) for c in columns(collapsed, data.num_stages)) <= MAX_ROWS
    assert sorted(u for b in collapsed.blocks for u in b.units) == list(range(len(stage_of_unit)))
    assert all(stage_of_unit[u] == b.stage for b in collapsed.blocks for u in b.units)
    assert any(b.cls == "GPT2Attention" for b in collapsed.blocks)  # module scopes, not ops
    for src, dst in collapsed.edges:  # data flows down a stage or to a later one
        assert src < dst and collapsed.blocks[src].stage <= collapsed.blocks[dst].stage
    assert set(collapsed.inputs) == {"input_ids", "labels"}


def test_not_a_pipeline(tmp_path):
    with pytest.raises(ArtifactError, match="not a compiled pipeline"):
        write_report(tmp_path)
    with pytest.raises(ArtifactError, match="not a compiled pipeline"):
        show_table(tmp_path)


def _chromium() -> str | None:
    import shutil

    return next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
def test_report_renders_in_a_real_browser(gpt2_dir, tmp_path):
    """Headless Chromium (Debian's package) loads the page offline and paints its figures."""
    import matplotlib.image

    page = write_report(gpt2_dir)
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    # the stage colours of the figures (not just text on white) are on the screen
    colours = {tuple((p * 15).round().astype(int)) for p in pixels.reshape(-1, 3)[::37]}
    assert len(colours) > 20
    blue = (abs(pixels[..., 2] - pixels[..., 0]) > 0.2).mean()  # forward bars, stage 0 boxes
    assert blue > 0.005
