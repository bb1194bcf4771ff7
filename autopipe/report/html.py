"""The report: ``DIR/report/report.html`` with its figures inlined, and the figures beside it.

The page is self-contained (figures inlined as SVG, styles inline, no scripts, nothing fetched)
and deterministic: the same compiled pipeline (and the same traced run, with ``--run``) gives
the same bytes.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..artifacts import AUTOPIPE_VERSION
from ..tensor_parallel import find_regions
from .summary import (
    MEMORY_PARTS,
    dimensions_text,
    network_lines,
    requested_lines,
    throughput_line,
)
from ..artifacts import atomic_write_bytes
from .data import ReportData, format_bytes, format_count
from .figures import (
    memory_figure,
    run_stages_figure,
    run_timeline_figure,
    save_figure,
    timeline_figure,
    times_figure,
)
from .modelgraph import model_graph_figure
from .run import DRAW_SCALED, FAR, RunComparison

REPORT_DIR = "report"
TEMPLATE = "report.html.j2"
#: the figures of the measured run's section (``--run``)
RUN_FIGURES = ("run_timeline", "run_stages")


@dataclass
class FigureFile:
    """One figure of the report: its file stem, heading, caption and images."""

    name: str
    title: str
    caption: str
    svg: str
    png: bytes

    @property
    def inline_svg(self) -> str:
        return inline_svg(self.svg, prefix=f"{self.name}-")


def inline_svg(svg: str, prefix: str) -> str:
    """An SVG document as an element for an HTML page: no XML prolog, metadata or namespace
    declarations, and its ids prefixed so that several figures on one page cannot clash."""
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    if not ids:
        return svg
    pattern = "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
    svg = re.sub(rf'\bid="({pattern})"', rf'id="{prefix}\1"', svg)
    return re.sub(rf'(href="#|url\(#)({pattern})(?=[")])', rf"\1{prefix}\2", svg)


def figures(data: ReportData) -> list[FigureFile]:
    """Draw every figure of the report."""
    bound = data.lower_bound * 1e3
    graph_fig, graph_caption = model_graph_figure(data)
    specs = [
        (
            "times",
            "Time per microbatch",
            times_figure(data),
            "Forward and backward compute of one microbatch per stage (and per device, the sum "
            "of its stages, when a device runs several), written on each bar in ms, with the "
            "time its transfers take beside it (they overlap compute). "
            f"The dashed line is the lower bound on the busiest device, {bound:.3f} ms: the total "
            "compute spread evenly over the devices, or the heaviest unit.",
        ),
        (
            "timeline",
            "Predicted timeline of one step",
            timeline_figure(data),
            f"The {data.schedule} schedule with {data.microbatches} microbatches, simulated event "
            "by event: a box per action, labelled stage, kind and microbatch (1F3: stage 1, "
            "forward, microbatch 3; just the stage where the box is narrow). Gaps are idle time.",
        ),
        (
            "memory",
            "Memory per device",
            memory_figure(data),
            "Predicted peak memory: parameters, gradients and optimizer state of the device's "
            "stages (its 1/N share with --dp-shard N, plus the parameters and gradients FSDP2 "
            "holds gathered at once), plus the most activations the schedule keeps alive at once.",
        ),
        (
            "graph",
            "Model graph by stage",
            graph_fig,
            f"{graph_caption}. A column per stage, blocks in program order; dark arrows carry "
            "values to a later stage, brackets on the left skip blocks within a stage.",
        ),
    ]
    return [
        FigureFile(name, title, caption, *save_figure(fig)) for name, title, fig, caption in specs
    ]


def run_figures(run: RunComparison) -> list[FigureFile]:
    """Draw the figures of the measured run's section."""
    layout, shown = run.trace.run, run.shown_run
    replicas = (
        f" The run had {layout.dp_size} data-parallel replicas; the rows are replica 0's ranks."
        if layout.dp_size > 1
        else ""
    )
    which = f"step {shown.step}" + (f", round {shown.round}," if layout.accumulate > 1 else "")
    if run.drawn_scale != 1:
        drawn = (
            f"The predicted times are drawn multiplied by the scale, x{run.drawn_scale:.2f} "
            f"(it is beyond {DRAW_SCALED:g}x either way: the prediction is for another device), "
            "so that the shapes compare; the title gives the predicted time as predicted."
        )
    else:
        drawn = "The predicted times are drawn as predicted."
    specs = [
        (
            "run_timeline",
            "Measured and predicted timeline of a pipeline run",
            run_timeline_figure(run),
            f"Above, the first traced pipeline run ({which} of steps "
            f"{run.trace.steps[0]}-{run.trace.steps[-1]}) as measured, from its first action's "
            f"start; below, the same run as predicted ({layout.schedule} schedule, "
            f"{layout.microbatches} microbatches), on the same time axis. Boxes are labelled as "
            f"in the predicted timeline of a step; gaps are idle time.{replicas} {drawn}",
        ),
        (
            "run_stages",
            "Measured and predicted time per microbatch",
            run_stages_figure(run),
            "Left: each stage's forward and backward of one microbatch, measured (solid, the "
            "mean over the traced steps, microbatches and replicas) and predicted (hatched, "
            "drawn as the timeline above draws it). Right: measured over predicted; the dashed "
            f"line is the scale, x{run.scale:.2f}, the run's measured compute over the "
            "predicted. A stage far above or below the line ran slower or faster than the "
            "prediction says relative to the others.",
        ),
    ]
    return [
        FigureFile(name, title, caption, *save_figure(fig)) for name, title, fig, caption in specs
    ]


def summary_rows(data: ReportData) -> list[tuple[str, str]]:
    """The header table: what was compiled, how, and what it is predicted to do."""
    predicted, settings = data.predicted, data.settings
    bottleneck = 0.0 if predicted is None else predicted.bottleneck
    bound = data.lower_bound
    over = max((bottleneck / bound - 1) * 100, 0.0) if bound else 0.0  # float error: not -0.0
    device = "?" if settings.device is None else settings.device
    if settings.link:
        device += f", link {settings.link}"
    step_time = 0.0 if predicted is None else predicted.step_time
    bubble = data.simulation.bubble if predicted is None else predicted.bubble
    peak = data.device_peak_memory()
    rows = [
        ("model", data.model_name),
        ("source", str(data.graph.model.source or "")),
        ("stages", str(data.num_stages)),
        ("devices", str(data.num_devices)),
        ("method", data.partition.method),
        ("schedule", f"{data.schedule}, {data.microbatches} microbatches"),
        ("cost model", data.partition.profile_source),
        ("optimizer", "?" if settings.optimizer is None else settings.optimizer),
        ("predicted pipeline run (before the optimizer)", f"{step_time * 1e3:.3f} ms"),
        (
            "bottleneck vs lower bound",
            f"{bottleneck * 1e3:.3f} ms vs {bound * 1e3:.3f} ms (+{over:.1f}%)",
        ),
        ("bubble", f"{bubble * 100:.1f}% idle"),
        (
            "peak memory",
            f"{format_bytes(max(peak))} of {format_bytes(data.memory_capacity)} per device",
        ),
        ("throughput", throughput_line(data.graph, data.partition).removeprefix("plan: ")),
        (
            "network",
            " ".join(network_lines(data.partition)).removeprefix("network: "),
        ),
        ("tensor parallelism", find_regions(data.graph).summary().removeprefix("tensor-parallel ")),
        ("dynamic dimensions", dimensions_text(data.graph, data.partition)),
        ("split asked for", " ".join(requested_lines(data.partition))),
    ]
    return [(key, value) for key, value in rows if value]


def render_html(
    data: ReportData,
    figure_files: list[FigureFile],
    run: RunComparison | None = None,
    run_figure_files: list[FigureFile] | None = None,
) -> str:
    """The report page; with ``run``, its measured run's section and figures."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(importlib.resources.files("autopipe.templates"))),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["bytes"] = format_bytes
    env.filters["count"] = format_count
    return env.get_template(TEMPLATE).render(
        data=data,
        summary=summary_rows(data),
        stages=data.stages,
        figures=figure_files,
        memory_peaks=data.memory_peaks,
        memory_parts=MEMORY_PARTS,
        plans=data.settings.plans or (),
        run=run,
        run_figures=run_figure_files or [],
        far=FAR,
        version=AUTOPIPE_VERSION,
    )


def write_report(directory: str | os.PathLike, run: str | os.PathLike | None = None) -> Path:
    """Write ``DIR/report/report.html`` and its figures (``DIR/report/*.svg``, ``*.png``) for
    the pipeline compiled into ``directory``, with the measured run's section when ``run``
    names the ``--trace`` directory of a run of it; returns the path of the page."""
    data = ReportData.load(directory)
    return write_pages(data, None if run is None else RunComparison.load(data, run))


def write_pages(data: ReportData, run: RunComparison | None) -> Path:
    """Write the report of ``data`` (with ``run``'s section, or without one: then the run
    figures of an earlier report are removed); returns the path of the page."""
    out = data.directory / REPORT_DIR
    figure_files = figures(data)
    run_figure_files = run_figures(run) if run is not None else []
    for figure in figure_files + run_figure_files:
        atomic_write_bytes(out / f"{figure.name}.svg", figure.svg.encode())
        atomic_write_bytes(out / f"{figure.name}.png", figure.png)
    if run is None:
        for name in RUN_FIGURES:
            for ext in ("svg", "png"):
                (out / f"{name}.{ext}").unlink(missing_ok=True)
    page = out / "report.html"
    atomic_write_bytes(page, render_html(data, figure_files, run, run_figure_files).encode())
    return page
