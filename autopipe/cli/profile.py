"""``autopipe profile``: cost every unit of a graph (profile.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compiler import load_graph, profile_step
from ..spec import load_example
from .arguments import Subparsers, compile_options, profile_options
from .output_file import output_file

__all__ = ["add_parser", "cmd_profile"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="cost every unit of a graph (profile.json)",
        description="Profile the units of a traced graph.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument(
        "-o",
        "--output",
        default="profile.json",
        type=output_file("profile.json"),
        help="profile artefact to write (default profile.json)",
    )
    p.add_argument(
        "--spec",
        help="model spec for --profile measured (default: the spec the graph was traced from)",
    )
    profile_options(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    spec = args.spec or graph.model.source
    example = load_example(spec) if (args.profile == "measured" and spec) else None
    prof = profile_step(graph, compile_options(args), example)
    prof.save(args.output)
    total = sum(u.time for u in prof.units)
    print(
        f"profiled {len(prof.units)} units ({prof.source}): {total * 1e3:.3f} ms forward + "
        f"backward -> {args.output}"
    )
