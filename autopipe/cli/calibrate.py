"""``autopipe calibrate``: measure this machine's device into a device spec."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from ..artifacts import atomic_write_text
from ..profiling.calibrate import calibrate
from .arguments import Subparsers
from .output_file import output_file

__all__ = ["add_parser", "cmd_calibrate"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's device into a device spec",
        description="Measure matmul FLOP/s, memory and link bandwidth of the local device and write a device spec JSON for --device-spec.",
    )
    p.add_argument(
        "-o",
        "--output",
        default="device.json",
        type=output_file("device.json"),
        help="spec file to write (default device.json)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="device to measure (default: cuda when present, else cpu)",
    )
    p.add_argument("--name", help="name of the spec (default: the device's name)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads to measure with: the threads each rank computes with (default 1, what "
        "torchrun gives each of several ranks per node; set it to the OMP_NUM_THREADS of your "
        "ranks). Ignored on a GPU",
    )
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> None:
    device = torch.device(args.device) if args.device else None
    spec = calibrate(
        device,
        args.name,
        log=lambda message: print(message, file=sys.stderr),
        threads=args.threads,
    )
    atomic_write_text(args.output, json.dumps(spec.to_json(), indent=1) + "\n")
    print(
        f"wrote device spec {spec.name!r} to {args.output}; use it with --device-spec "
        f"{shlex.quote(str(args.output))}"
    )
