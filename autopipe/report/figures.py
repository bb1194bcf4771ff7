"""The report's charts, drawn with matplotlib and saved deterministically.

Each ``*_figure`` function takes a :class:`~.data.ReportData` and returns a matplotlib figure;
:func:`save_figure` writes it as SVG and PNG (Agg) whose bytes depend only on the data: fixed
fonts and sizes, a fixed SVG hash salt, and no dates in the metadata. Figures are made without
pyplot, so drawing a report touches neither the user's backend nor pyplot's figure list.
"""

from __future__ import annotations

from contextlib import contextmanager
from io import BytesIO
from collections.abc import Iterator, Sequence

import matplotlib
import matplotlib.style
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .data import KIND_NAMES, ReportData, StageRow
from .run import Event, RunComparison

#: colours (Tableau 10) of the kinds of action and of memory
COLOURS = {
    "F": "#4e79a7",  # forward: blue
    "B": "#f28e2b",  # backward: orange
    "I": "#e15759",  # input backward: red
    "W": "#b07aa1",  # weight backward: purple
    "comm": "#76b7b2",  # communication: teal
    "parameters": "#4e79a7",
    "gradients": "#a0cbe8",
    "optimizer": "#59a14f",
    "gathered": "#bab0ac",
    "activations": "#f28e2b",
    "buffers": "#76b7b2",
    "input_gradients": "#edc948",
    "transient": "#ff9da7",
}
#: rcParams every figure is drawn under: same inputs, same bytes
STYLE = {
    "svg.hashsalt": "autopipe",
    "svg.fonttype": "path",
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "figure.dpi": 100,
    "savefig.dpi": 120,
    "path.simplify": False,
}
WIDTH = 9.0  # inches: every chart has the page's width
LABEL_SIZE = 6.5  # points: labels inside boxes


@contextmanager
def style() -> Iterator[None]:
    """Draw under :data:`STYLE` over matplotlib's defaults, whatever the user's matplotlibrc."""
    with matplotlib.style.context(["default", STYLE]):
        yield


def save_figure(fig: Figure) -> tuple[str, bytes]:
    """The figure as SVG text and PNG bytes, both free of dates and versions."""
    with style():
        svg, png = BytesIO(), BytesIO()
        fig.savefig(svg, format="svg", metadata={"Date": None, "Creator": None})
        fig.savefig(png, format="png", metadata={"Software": None})
    return svg.getvalue().decode("utf-8"), png.getvalue()


def stage_colour(stage: int) -> tuple:
    """The colour of a stage, the same in every chart (tab10, then tab20 for more stages)."""
    return matplotlib.colormaps["tab10" if stage < 10 else "tab20"](stage % 20)


# -- times ------------------------------------------------------------------------------------
def times_figure(data: ReportData) -> Figure:
    """Forward + backward time of one microbatch per stage and per device (one panel when each
    device runs one stage), communication beside it, against the lower bound on the busiest
    device's time."""
    stages = data.stages
    per_stage = ([[r] for r in stages], [f"stage {r.stage}\ndevice {r.device}" for r in stages])
    panels = {"per stage, one microbatch": per_stage}
    if data.partition.device_of_stage != list(range(data.num_stages)):
        devices = range(data.num_devices)
        panels["per device, one microbatch"] = (
            [[r for r in stages if r.device == d] for d in devices],
            [_device_label(data, d) for d in devices],
        )
    bound = data.lower_bound * 1e3
    heights = [
        sum(r.forward + r.backward for r in group) * 1e3
        for groups, _ in panels.values()
        for group in groups
    ]
    top = max([bound, *heights]) * 1.2
    with style():
        widths = [1.0 * len(stages)] + [1.4 * data.num_devices] * (len(panels) - 1)
        fig = Figure(figsize=(WIDTH, 3.4))
        axes = fig.subplots(
            1,
            len(panels),
            sharey=True,
            squeeze=False,
            gridspec_kw={"width_ratios": widths},
        )
        for ax, (title, (groups, labels)) in zip(axes[0], panels.items()):
            _time_bars(ax, groups)
            ax.axhline(
                bound,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"lower bound {bound:.2f} ms",
            )
            ax.set_xticks(range(len(groups)), labels)
            ax.set_xlim(-0.6, len(groups) - 0.4)
            ax.set_title(title)
        axes[0][0].set_ylim(0, top)
        axes[0][0].set_ylabel("ms")
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 1.0))
        fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _time_bars(ax: Axes, groups: list[list[StageRow]]) -> None:
    """Stacked forward + backward bars with their total written on them, communication beside."""
    x = range(len(groups))
    fwd = [sum(r.forward for r in group) * 1e3 for group in groups]
    bwd = [sum(r.backward for r in group) * 1e3 for group in groups]
    comm = [sum(r.communication for r in group) * 1e3 for group in groups]
    left = [i - 0.12 for i in x]
    ax.bar(left, fwd, 0.5, color=COLOURS["F"], label="forward")
    ax.bar(left, bwd, 0.5, bottom=fwd, color=COLOURS["B"], label="backward")
    ax.bar([i + 0.25 for i in x], comm, 0.16, color=COLOURS["comm"], label="communication")
    for i, (f, b, c) in enumerate(zip(fwd, bwd, comm)):
        total = f + b  # written half-way up the bar, clear of the lower-bound line
        ax.text(
            left[i],
            total / 2,
            f"{total:.2f}",
            ha="center",
            va="center",
            fontsize=7.5,
            color="white",
            bbox={"boxstyle": "round,pad=0.15", "color": COLOURS["B"]},
        )
        ax.annotate(
            _short_time(c),
            (i + 0.25, c),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=90,
            color="#555555",
        )


def _short_time(ms: float) -> str:
    """``1.25 ms``, ``12.5 µs``, ``40 ns``."""
    if ms >= 0.1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.1f} µs" if ms >= 1e-4 else f"{ms * 1e6:.0f} ns"


def _device_label(data: ReportData, device: int) -> str:
    stages = data.stages_on(device)
    return f"device {device}\nstage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


# -- timeline ---------------------------------------------------------------------------------
def timeline_figure(data: ReportData) -> Figure:
    """Gantt chart of the simulated step: one row per device, one box per action (forward and
    backward in their colours, labelled ``1F3``: stage 1, forward, microbatch 3); gaps are
    bubbles."""
    sim = data.simulation
    end = sim.step_time * 1e3 or 1.0
    with style():
        height = 1.3 + 0.55 * data.num_devices
        fig = Figure(figsize=(WIDTH, height))
        ax = fig.subplots()
        labels = [_device_label(data, d).replace("\n", ", ") for d in range(data.num_devices)]
        kinds = _gantt(ax, sim.events, labels, end)
        ax.legend(
            handles=_kind_handles(kinds),
            loc="upper center",
            ncol=len(kinds) + 1,
            bbox_to_anchor=(0.5, 1.0 + 0.5 / height),
        )
        ax.set_xlabel(
            f"ms ({data.microbatches} microbatches, {data.schedule} schedule, "
            f"step {end:.2f} ms, {sim.bubble * 100:.0f}% idle)"
        )
        fig.tight_layout()
    return fig


def run_timeline_figure(run: RunComparison) -> Figure:
    """Gantt charts of a pipeline run, measured above predicted on the same time axis: one row
    per pipeline rank (those of data-parallel replica 0 for the measured run), boxes as in
    :func:`timeline_figure`; the predicted times multiplied by the comparison's
    :attr:`~.run.RunComparison.drawn_scale`."""
    measured, predicted = run.measured_events, run.predicted_events
    end = max(e[3] for e in [*measured, *predicted]) * 1e3 or 1.0
    layout, shown = run.trace.run, run.shown_run
    ranks = {t.pp_rank: t for t in run.trace.timelines if t.dp_rank == 0}
    measured_labels = [
        f"rank {ranks[p].rank}, {_stages_text(ranks[p].stages)}" for p in range(layout.pp_size)
    ]
    predicted_labels = [
        f"device {d}, {_stages_text(tuple(run.data.stages_on(d)))}"
        for d in range(run.data.num_devices)
    ]
    round_ = f", round {shown.round}" if layout.accumulate > 1 else ""
    scaled = f", drawn x{run.drawn_scale:.2f}" if run.drawn_scale != 1 else ""
    titles = (
        f"measured: step {shown.step}{round_}, {shown.seconds * 1e3:.2f} ms, "
        f"{shown.bubble * 100:.0f}% idle",
        f"predicted: {run.simulation.step_time * 1e3:.2f} ms, "
        f"{run.simulation.bubble * 100:.0f}% idle{scaled}",
    )
    with style():
        rows = len(measured_labels) + len(predicted_labels)
        height = 2.2 + 0.5 * rows
        fig = Figure(figsize=(WIDTH, height))
        axes = fig.subplots(
            2,
            1,
            sharex=True,
            gridspec_kw={"height_ratios": [len(measured_labels), len(predicted_labels)]},
        )
        kinds: list[str] = []
        for ax, events, labels, title in zip(
            axes, (measured, predicted), (measured_labels, predicted_labels), titles
        ):
            kinds += [k for k in _gantt(ax, events, labels, end) if k not in kinds]
            ax.set_title(title, loc="left")
        kinds.sort(key="FBIW".index)
        fig.legend(
            handles=_kind_handles(kinds),
            loc="upper center",
            ncol=len(kinds) + 1,
            bbox_to_anchor=(0.5, 1.0),
        )
        axes[1].set_xlabel(
            f"ms from the run's start ({layout.microbatches} microbatches, "
            f"{layout.schedule} schedule)"
        )
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))
    return fig


def _gantt(ax: Axes, events: Sequence[Event], labels: list[str], end: float) -> list[str]:
    """Draw ``events`` (row, action, start and end in seconds) as boxes on one row per label,
    labelled where they fit, from 0 to ``end`` ms; returns the kinds of action drawn."""
    rows = len(labels)
    # points per ms of the time axis, to leave out labels that do not fit their box
    scale = WIDTH * 72 * 0.86 / end
    for kind in "FBIW":
        for row in range(rows):
            boxes = [
                (start * 1e3, (finish - start) * 1e3)
                for r, a, start, finish in events
                if r == row and a.kind == kind
            ]
            ax.broken_barh(
                boxes,
                (row - 0.35, 0.7),
                facecolors=COLOURS[kind],
                edgecolor="white",
                linewidth=0.6,
            )
    for row, action, start, finish in events:
        width = (finish - start) * 1e3
        text = next(
            (
                t
                for t in (str(action), str(action.stage))
                if width * scale > 0.62 * LABEL_SIZE * len(t) + 2
            ),
            None,
        )
        if text:
            ax.text(
                (start + finish) / 2 * 1e3,
                row,
                text,
                ha="center",
                va="center",
                fontsize=LABEL_SIZE,
                color="white",
            )
    ax.set_yticks(range(rows), labels)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    return sorted({a.kind for _, a, _, _ in events}, key="FBIW".index)


def _kind_handles(kinds: Sequence[str]) -> list[Patch]:
    """Legend entries: the kinds of action, and idle time."""
    handles = [Patch(color=COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle (bubble)"))
    return handles


def _stages_text(stages: Sequence[int]) -> str:
    return f"stage{'s' if len(stages) != 1 else ''} {', '.join(map(str, stages))}"


def run_stages_figure(run: RunComparison) -> Figure:
    """Each stage's measured forward and backward per microbatch beside the predicted (times
    the comparison's drawn scale, as in :func:`run_timeline_figure`), and their measured /
    predicted ratios against the run's scale."""
    stages = run.stages
    x = range(len(stages))
    factor = run.drawn_scale
    predicted = "predicted" + (f" x{factor:.2f}" if factor != 1 else "")
    with style():
        fig = Figure(figsize=(WIDTH, 3.4))
        left, right = fig.subplots(1, 2)
        bars = (
            ("F", "forward, measured", [s.measured_forward for s in stages], -0.3, False),
            (
                "F",
                f"forward, {predicted}",
                [s.predicted_forward * factor for s in stages],
                -0.1,
                True,
            ),
            ("B", "backward, measured", [s.measured_backward for s in stages], 0.1, False),
            (
                "B",
                f"backward, {predicted}",
                [s.predicted_backward * factor for s in stages],
                0.3,
                True,
            ),
        )
        for kind, label, values, offset, hollow in bars:
            left.bar(
                [i + offset for i in x],
                [v * 1e3 for v in values],
                0.2,
                color="white" if hollow else COLOURS[kind],
                edgecolor=COLOURS[kind],
                hatch="////" if hollow else None,
                linewidth=0.8,
                label=label,
            )
        left.set_ylabel("ms per microbatch")
        left.set_title("measured and predicted")
        ratios = (
            ("F", "forward", [s.forward_ratio for s in stages], -0.15),
            ("B", "backward", [s.backward_ratio for s in stages], 0.15),
        )
        for kind, label, values, offset in ratios:
            right.bar([i + offset for i in x], values, 0.3, color=COLOURS[kind], label=label)
        right.axhline(
            run.scale,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"scale x{run.scale:.2f}",
        )
        right.set_title("measured / predicted")
        for ax in (left, right):
            ax.set_xticks(x, [f"stage {s.stage}" for s in stages])
            ax.set_xlim(-0.6, len(stages) - 0.4)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
        fig.tight_layout()
    return fig


# -- memory -----------------------------------------------------------------------------------
def memory_figure(data: ReportData) -> Figure:
    """Predicted peak memory per device, stacked (parameters, gradients, optimizer state, each
    the device's shard when sharded, what FSDP2 holds gathered, receive buffers, activations
    in flight, received-input gradients, the transient at the peak), against the device's
    capacity."""
    peak = data.device_peak_memory()
    capacity = data.memory_capacity
    unit, size = _memory_unit(max(max(peak), 1.0))
    parts = data.device_peak_parts()
    shard = f" (1/{data.dp_shard})" if data.dp_shard > 1 else ""
    names = {
        "parameters": f"parameters{shard}",
        "gradients": f"gradients{shard}",
        "optimizer": f"optimizer state{shard}",
        "gathered": "gathered by FSDP2",
        "buffers": "receive buffers",
        "activations": "activations in flight",
        "input_gradients": "received-input gradients",
        "transient": "transient",
    }
    with style():
        fig = Figure(figsize=(WIDTH * 0.6, 3.2))
        ax = fig.subplots()
        x = list(range(data.num_devices))
        bottom = [0.0] * len(x)
        for key, values in parts.items():
            if not any(values):
                continue
            ax.bar(
                x,
                [v / size for v in values],
                0.55,
                bottom=bottom,
                color=COLOURS[key],
                label=names.get(key, key),
            )
            bottom = [b + v / size for b, v in zip(bottom, values)]
        for i, total in enumerate(peak):
            ax.annotate(
                f"{total / size:.1f}",
                (i, total / size),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        top = max(peak) / size * 1.25
        if capacity / size <= top * 1.5:  # the capacity line fits the chart
            top = max(top, capacity / size * 1.08)
            ax.axhline(
                capacity / size,
                color="#c00000",
                linestyle="--",
                linewidth=1,
                label=f"capacity {capacity / size:.1f} {unit}",
            )
        else:
            ax.set_title(
                f"capacity {capacity / 1024**3:.0f} GiB per device (off the chart): "
                f"peak uses {max(peak) / capacity * 100:.2g}%",
                fontsize=8,
            )
        ax.set_ylim(0, top)
        ax.set_xticks(x, [_device_label(data, d) for d in x])
        ax.set_xlim(-0.6, len(x) - 0.4)
        ax.set_ylabel(unit)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
    return fig


def _memory_unit(value: float) -> tuple[str, float]:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return unit, size
    return "B", 1.0
