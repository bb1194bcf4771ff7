"""A generated package's train.py with a hang, or a slow rank, planted on one rank: run under
torchrun with ``PLANTED_PACKAGE`` (the package directory), ``PLANTED`` (what to plant),
``PLANTED_RANK`` and ``PLANTED_DIR`` in the environment, and train.py's own arguments. Every rank
writes its process id to ``PLANTED_DIR/rankR.pid``; the plant writes the time it strikes to
``PLANTED_DIR/struck``. The package's stage forwards are counted per rank: with 4 microbatches,
call 4 is step 1's microbatch 0 (a stop there leaves nothing of step 1 sent: gloo's threads,
which send in the background, stop with the process).

``stop``
    the rank stops itself (SIGSTOP) in step 1's forward of microbatch 0
``shape``
    its stage returns an output one row longer in step 1's forward of microbatch 0
``skip``
    its gradient sync skips the collectives of the tied gradients' sum at step 1
``slow``
    each of its stage forwards sleeps ``PLANTED_SLOW`` seconds, and step 2's first one
    ``PLANTED_LONG`` seconds more (``struck`` is written as that sleep starts)
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import torch

from package_main import run_package

#: the stage forward call the plants strike at (step 1, microbatch 0 of 4)
STRIKE = 4


def _struck(directory: Path) -> None:
    (directory / "struck").write_text(f"{time.time()}\n")


def _planted_forward(forward, plant: str, directory: Path):
    calls = [0]

    @functools.wraps(forward)
    def planted(*args, **kwargs):
        call, calls[0] = calls[0], calls[0] + 1
        if plant == "stop" and call == STRIKE:
            _struck(directory)
            os.kill(os.getpid(), signal.SIGSTOP)
        if plant == "slow":
            time.sleep(float(os.environ["PLANTED_SLOW"]))
            if call == 8:  # step 2's first forward
                _struck(directory)
                time.sleep(float(os.environ["PLANTED_LONG"]))
        outputs = forward(*args, **kwargs)
        if plant == "shape" and call == STRIKE:
            _struck(directory)
            first = outputs[0]
            outputs = (torch.cat([first, first[:1]]), *outputs[1:])  # one more row
        return outputs

    return planted


def _skipping(reduce, directory: Path):
    calls = [0]

    @functools.wraps(reduce)
    def skipping(self):
        call, calls[0] = calls[0], calls[0] + 1
        if call == 1:  # step 1: its collectives are left out on this rank
            _struck(directory)
            return
        reduce(self)

    return skipping


def _plant(package) -> None:
    """Plants ``PLANTED`` in ``package`` on rank ``PLANTED_RANK``."""
    directory = Path(os.environ["PLANTED_DIR"])
    (directory / f"rank{os.environ['RANK']}.pid").write_text(f"{os.getpid()}\n")
    if os.environ["RANK"] != os.environ["PLANTED_RANK"]:
        return
    plant = os.environ["PLANTED"]
    if plant == "skip":
        parallel = importlib.import_module(f"{package.__name__}.runtime.parallel")
        parallel.GradientSync.reduce = _skipping(parallel.GradientSync.reduce, directory)
    else:
        for stage_class in package.STAGES:
            stage_class.forward = _planted_forward(stage_class.forward, plant, directory)


if __name__ == "__main__":
    sys.exit(run_package(Path(os.environ["PLANTED_PACKAGE"]), _plant))
