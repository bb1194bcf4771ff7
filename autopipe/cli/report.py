"""``autopipe report``: write the HTML report of a compiled pipeline (and of a run of it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report import run_report, write_report
from .arguments import Subparsers

__all__ = ["add_parser", "cmd_report"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="write the HTML report of a compiled pipeline",
        description="Write DIR/report/report.html (stage times, simulated timeline, memory per "
        "device, model graph by stage) and its figures as SVG and PNG. With --run, add the "
        "measured run beside its prediction and print a summary of it.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.add_argument(
        "--run",
        type=Path,
        metavar="TRACE_DIR",
        help="the --trace directory of a train.py run of this pipeline: compare its measured "
        "timeline, stage times and bubble with the prediction of that run",
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> None:
    if args.run is None:
        print(f"wrote {write_report(args.dir)}")
        return
    page, summary = run_report(args.dir, args.run)
    print(f"wrote {page}")
    print(summary)
