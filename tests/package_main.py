"""The shared part of the test scripts that run a generated package's train.py with something
changed on one rank (``tests/planted_train.py``, ``tests/slowed_train.py``): on a rank,
each loads the package through its train.py, changes it, then runs its driver as train.py would.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def run_package(package_dir: Path, change: Callable[[ModuleType], None]) -> int:
    """train.py of the package in ``package_dir`` on this rank's arguments, after ``change``
    (given the package, loaded but not run yet); its exit status."""
    spec = importlib.util.spec_from_file_location("changed_train", package_dir / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)  # defines load_pipeline_package; its __main__ part not run
    package = train.load_pipeline_package()
    change(package)
    driver = importlib.import_module(f"{package.__name__}.runtime.driver")
    return driver.main(package, sys.argv[1:])
