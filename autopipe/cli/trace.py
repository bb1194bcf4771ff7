"""``autopipe trace``: capture the model into a graph (graph.json)."""

from __future__ import annotations

import argparse

from ..compiler import trace_step
from ..spec import load_example
from .arguments import SPEC_HELP, Subparsers, compile_options, trace_options
from .output_file import output_file

__all__ = ["add_parser", "cmd_trace"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "trace",
        help="capture the model into a graph (graph.json)",
        description="Trace a model with torch.export into the graph IR.",
    )
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument(
        "-o",
        "--output",
        default="graph.json",
        type=output_file("graph.json"),
        help="graph artefact to write (default graph.json)",
    )
    trace_options(p)
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    graph = trace_step(example, compile_options(args), source=args.spec, loss=args.loss)
    graph.save(args.output)
    print(f"traced {len(graph.calls)} operators in {len(graph.units)} units -> {args.output}")
