"""Reports of a compiled pipeline: ``autopipe report DIR [--run TRACE]`` and ``autopipe show DIR``.

:func:`write_report` reads what ``autopipe compile`` left in a directory (``pipeline.json`` and
the graph / profile / partition artefacts) and writes ``DIR/report/report.html``, a
self-contained page with the predicted stage times, the simulated timeline of a step, memory per
device and the model graph coloured by stage, plus those figures as SVG and PNG files. Given the
``--trace`` directory of a ``train.py`` run, it adds a section that sets the measured run beside
its prediction (:class:`RunComparison`); :func:`run_report` writes that page and returns the
comparison's text summary too. :func:`show_table` gives the per-stage table as plain text.

matplotlib is imported only when a report is written, so ``show_table`` stays quick.
"""

from __future__ import annotations

import os
from pathlib import Path

from .data import ReportData
from .run import RunComparison
from .table import show_table


def write_report(directory: str | os.PathLike, run: str | os.PathLike | None = None) -> Path:
    """Write the report of the pipeline compiled into ``directory``, with the measured run's
    section when ``run`` is the ``--trace`` directory of a run of it; returns the HTML page."""
    from .html import write_report as write

    return write(directory, run)


def run_report(directory: str | os.PathLike, run: str | os.PathLike) -> tuple[Path, str]:
    """Write the report of the pipeline compiled into ``directory`` with the section of the
    run traced into ``run``; returns the page and the text summary of the run against its
    prediction (:meth:`RunComparison.summary`)."""
    from .html import write_pages

    comparison = RunComparison.load(ReportData.load(directory), run)
    return write_pages(comparison.data, comparison), comparison.summary()


__all__ = ["write_report", "run_report", "show_table", "ReportData", "RunComparison"]
