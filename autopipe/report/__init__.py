"""Reports of a compiled pipeline: ``autopipe report DIR`` and ``autopipe show DIR``.

:func:`write_report` reads what ``autopipe compile`` left in a directory (``pipeline.json`` and
the graph / profile / partition artefacts) and writes ``DIR/report/report.html``, a
self-contained page with the predicted stage times, the simulated timeline of a step, memory per
device and the model graph coloured by stage, plus those figures as SVG and PNG files.
:func:`show_table` gives the per-stage table as plain text.

matplotlib is imported only when a report is written, so ``show_table`` stays quick.
"""

from __future__ import annotations

import os
from pathlib import Path

from .data import ReportData
from .table import show_table


def write_report(directory: str | os.PathLike) -> Path:
    """Write the report of the pipeline compiled into ``directory``; returns the HTML page."""
    from .html import write_report as write

    return write(directory)


__all__ = ["write_report", "show_table", "ReportData"]
