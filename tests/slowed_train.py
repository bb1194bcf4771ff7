"""A generated package's train.py with one rank made slower on purpose: run under torchrun
with ``SLOWED_PACKAGE`` (the package directory), ``SLOWED_RANK`` and ``SLOWED_FACTOR`` in the
environment, and train.py's own arguments.

Every stage forward on rank ``SLOWED_RANK`` sleeps ``SLOWED_FACTOR - 1`` times its own
duration after running, as a device that many times slower would: the delay follows the units
the stage holds, so it shrinks when a replanned package moves units off that rank.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

from package_main import run_package


def _slowed(forward, factor: float):
    @functools.wraps(forward)
    def slow_forward(*args, **kwargs):
        start = time.perf_counter()
        result = forward(*args, **kwargs)
        time.sleep((factor - 1) * (time.perf_counter() - start))
        return result

    return slow_forward


def _slow(package) -> None:
    """Slows ``package``'s stage forwards on rank ``SLOWED_RANK``."""
    if os.environ.get("RANK") == os.environ["SLOWED_RANK"]:
        factor = float(os.environ["SLOWED_FACTOR"])
        for stage_class in package.STAGES:
            stage_class.forward = _slowed(stage_class.forward, factor)


if __name__ == "__main__":
    sys.exit(run_package(Path(os.environ["SLOWED_PACKAGE"]), _slow))
