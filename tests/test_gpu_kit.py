"""benchmarks/gpu.py, the one-GPU kit: on a machine without CUDA it says so and stops."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the kit would run")
def test_the_kit_stops_with_a_message_without_cuda(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--quick", "--json", str(tmp_path / "gpu.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "measures autopipe on a CUDA GPU" in result.stderr
    assert "--device cpu" in result.stderr  # what to do instead
    assert not (tmp_path / "gpu.json").exists()  # nothing half-written
