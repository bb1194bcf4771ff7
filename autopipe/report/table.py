"""``autopipe show DIR``: the stages of a compiled pipeline as a plain-text table."""

from __future__ import annotations

import os

from .data import ReportData, format_bytes, format_count

COLUMNS = ("stage", "device", "units", "params", "fwd ms", "bwd ms", "comm ms", "memory")


def show_table(directory: str | os.PathLike) -> str:
    """The per-stage table of the pipeline compiled into ``directory``: device, units,
    parameters, predicted forward / backward / communication time of one microbatch, predicted
    memory, and the values each stage receives and sends; with a line of settings above and the
    predicted step below."""
    data = ReportData.load(directory)
    rows = [
        (
            str(r.stage),
            str(r.device),
            str(r.units),
            format_count(r.parameters),
            f"{r.forward * 1e3:.3f}",
            f"{r.backward * 1e3:.3f}",
            f"{r.communication * 1e3:.3f}",
            format_bytes(r.memory) + (" (recompute)" if r.recompute else ""),
            ", ".join(r.inputs),
            ", ".join(r.outputs),
        )
        for r in data.stages
    ]
    header = (*COLUMNS, "inputs", "outputs")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(COLUMNS))]
    inputs_width = max(len(row[-2]) for row in [header, *rows])

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(width) for cell, width in zip(row, widths)]
        return " ".join([*cells, " " + row[-2].ljust(inputs_width), " " + row[-1]]).rstrip()

    predicted = data.predicted
    bottleneck = 0.0 if predicted is None else predicted.bottleneck
    bound = data.lower_bound
    step_time = 0.0 if predicted is None else predicted.step_time
    bubble = 0.0 if predicted is None else predicted.bubble
    over = max((bottleneck / bound - 1) * 100, 0.0) if bound else 0.0  # float error: not -0.0
    title = (
        f"{data.model_name}: {data.num_stages} stages on {data.num_devices} devices "
        f"(method {data.partition.method}, {data.schedule} schedule, {data.microbatches} microbatches)"
    )
    footer = (
        f"predicted step {step_time * 1e3:.3f} ms, "
        f"{bubble * 100:.0f}% bubble; bottleneck {bottleneck * 1e3:.3f} ms, "
        f"lower bound {bound * 1e3:.3f} ms (+{over:.1f}%)"
    )
    return "\n".join([title, line(header), *(line(row) for row in rows), footer])
