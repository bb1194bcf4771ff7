"""benchmarks/gpu.py, the one-GPU kit: on a machine without CUDA it says so and stops; its budget
skips what it cannot hold, saying so; its device script says how to use it."""

from __future__ import annotations

import importlib.util
import json
import shutil
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


@pytest.fixture
def kit_module(monkeypatch):
    """benchmarks/gpu.py as a module (its folder importable, as when it runs as a script)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_a_case_the_budget_cannot_hold_is_skipped_with_a_row(kit_module, tmp_path):
    """--budget: a process gets at most what is left; a case that would start with less than
    its least is not run, and its row says so (the kit's JSON written, as after every row)."""
    output = tmp_path / "gpu.json"
    kit = kit_module.Kit("cpu", True, tmp_path, "cpu", output, {}, budget=kit_module.Budget.of(100))
    assert 90 < kit.timeout(600) <= 100 and kit.timeout(30) == 30
    ran = []
    kit_module.attempt(
        kit, "calibration", "autopipe calibrate", lambda: ran.append(kit.timeout(900, least=120))
    )
    assert not ran
    (row,) = kit.rows
    assert row.verdict == "skipped" and row.measured.startswith("skipped: ")
    assert "s of --budget left" in row.measured
    assert json.loads(output.read_text())["rows"][0]["verdict"] == "skipped"
    unbounded = kit_module.Kit("cpu", False, tmp_path, "cpu", output, {})
    assert unbounded.timeout(1800) == 1800


def test_the_device_script_says_how_to_use_it(tmp_path):
    """benchmarks/gpu_device.sh: without a step, or run before prepare, it says what to do."""
    script = ROOT / "benchmarks" / "gpu_device.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "prepare | run" in usage.stderr
    copy = tmp_path / "repo" / "benchmarks"
    copy.mkdir(parents=True)
    shutil.copy(script, copy)
    unprepared = subprocess.run(
        ["bash", str(copy / "gpu_device.sh"), "run", "--quick"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert unprepared.returncode == 2 and "gpu_device.sh prepare' first" in unprepared.stderr
