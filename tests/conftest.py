"""Shared helpers: compile test models from their specs, run generated train.py on local ranks."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import black
import pytest
import torch
import torch.distributed as dist

from autopipe.codegen.package import BLACK_MODE
from autopipe.compiler import CompileOptions, CompileResult, compile_spec
from autopipe.runtime.parallel import Layout

from ranks import RANK_SETTINGS, run_together
from zoo.packages import Packages

ROOT = Path(__file__).resolve().parent.parent
MODELS = "tests/models.py"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Specs are given relative to the repository root, as a user would type them."""
    monkeypatch.chdir(ROOT)


def spec(name: str) -> str:
    """A model of tests/models.py by name, or any spec ``FILE.py:FN`` as it is."""
    return name if ":" in name else f"{MODELS}:{name}"


#: packages compiled with ``share=True``, by what they were compiled from: the folder holding a
#: copy and the compile's result (each test gets its own copy of the package)
_SHARED: dict[tuple, tuple[Path, CompileResult]] = {}


def compile_model(name: str, out: Path, stages: int, *, share: bool = True, **options):
    """Compile a model of tests/models.py (or any spec) into ``out``. With ``share`` (the
    default), a package compiled from the same spec file and options earlier in the session is
    copied instead (compiling is deterministic: tests/test_determinism.py compiles twice with
    ``share=False``), unless ``out`` exists already: a compile over a package is a real one."""
    loss = options.pop("loss", None)
    force = options.pop("force", False)
    report = options.pop("report", False)  # tests/test_report.py covers reports
    key = None
    if share and not Path(out).exists():
        key = (spec(name), _file_stamp(spec(name)), stages, repr(sorted(options.items())))
        key += (repr(loss), report)
        if key in _SHARED:
            folder, result = _SHARED[key]
            shutil.copytree(folder, out)
            return dataclasses.replace(result, out=Path(out))
    compiled = CompileOptions(stages=stages, **options)
    result = compile_spec(spec(name), out, compiled, loss=loss, force=force, report=report)
    assert_black_formatted(out)
    if key is not None:
        folder = Path(tempfile.mkdtemp(prefix="shared-package-", dir=_shared_root()))
        shutil.copytree(out, folder, dirs_exist_ok=True)
        _SHARED[key] = (folder, result)
    return result


#: a CPU as --device-spec cpu measures one (one thread): figures of its kind, fixed
CPU_SPEC = {
    "name": "cpu (test, 1 thread)",
    "flops": {"float32": 5e10, "default": 5e10},
    "memory_bandwidth": 1e10,
    "memory": 16 * 1024**3,
    "link_bandwidth": 1.5e9,
    "compute_efficiency": 1.0,
    "memory_efficiency": 1.0,
    "kernel_overhead": 5e-6,
    "device_type": "cpu",
}


def cpu_spec_file(folder: Path) -> Path:
    """:data:`CPU_SPEC` written as ``folder/cpu.json``, for ``--device-spec``."""
    path = folder / "cpu.json"
    path.write_text(json.dumps(CPU_SPEC))
    return path


def _file_stamp(model_spec: str) -> tuple[int, int] | None:
    """The modification time and size of a ``FILE.py:FN`` spec's file (None for a module)."""
    path = Path(model_spec.rpartition(":")[0])
    if path.suffix != ".py" or not path.exists():
        return None
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


#: where shared packages are kept (named on import: tests move the temporary directory)
_SHARED_ROOT = Path(tempfile.gettempdir()) / f"autopipe-tests-{os.getpid()}"


def _shared_root() -> Path:
    if not _SHARED_ROOT.exists():
        _SHARED_ROOT.mkdir()
        atexit.register(shutil.rmtree, _SHARED_ROOT, ignore_errors=True)
    return _SHARED_ROOT


def assert_black_formatted(package: Path) -> None:
    """Every generated Python file is exactly what black makes of it (autopipe emits forward
    bodies in black's layout itself; this checks that it does so)."""
    for path in sorted(package.glob("*.py")):
        text = path.read_text()
        assert (
            black.format_str(text, mode=BLACK_MODE) == text
        ), f"{path.name} is not black-formatted"


def torchrun_env() -> dict[str, str]:
    """The environment of torchrun in the tests: one thread per rank, no warnings."""
    return {**os.environ, **RANK_SETTINGS}


def torchrun_command(script: Path, nproc: int, *args: str) -> list[str]:
    """The command running a generated train.py on ``nproc`` local gloo ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc-per-node={nproc}", str(script), "--device", "cpu", *args]


def start_torchrun(
    script: Path, nproc: int, *args: str, stderr, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a generated train.py on ``nproc`` local gloo ranks without waiting for it
    (``env``: more variables)."""
    command = torchrun_command(script, nproc, *args)
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**torchrun_env(), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def run_ranks(
    script: Path, nproc: int, *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a generated train.py on ``nproc`` local gloo ranks as torchrun runs it, torch imported
    once for all (tests/ranks.py), with ``env``'s variables more; its result, checked to have
    succeeded. A run that must start as a user starts it: :func:`torchrun_failing`,
    :func:`start_torchrun`."""
    return run_ranks_together((script, nproc, list(args)), timeout=timeout, env=env)[0]


def run_ranks_together(
    *runs: tuple[Path, int, list[str]], timeout: int = 600, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Several independent runs of generated train.py files at once, each ``(script, nproc,
    args)`` on its own local gloo ranks (``env``: more variables for all), each checked as
    :func:`run_ranks` checks one."""
    on_cpu = [(script, nproc, ["--device", "cpu", *args]) for script, nproc, args in runs]
    results = run_together(on_cpu, {**torchrun_env(), **(env or {})}, ROOT, timeout)
    for result in results:
        if result.returncode != 0:
            raise AssertionError(
                f"train.py failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                f"{result.stderr[-8000:]}"
            )
    return results


def torchrun_failing(
    script: Path, nproc: int, *args: str, timeout: int = 300, env: dict[str, str] | None = None
):
    """Run a generated train.py expected to fail on ``nproc`` local gloo ranks under torchrun
    (``env``: more variables); its result."""
    result = subprocess.run(
        torchrun_command(script, nproc, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**torchrun_env(), **(env or {})},
        cwd=ROOT,
    )
    assert result.returncode != 0, f"train.py did not fail:\n{result.stdout[-4000:]}"
    return result


ONE_PROCESS = Layout(
    torch.device("cpu"), pp_size=1, dp_size=1, pp_rank=0, dp_rank=0, pp_group=None, dp_group=None
)


def training_state(package, num_stages):
    """Every stage of a package with an AdamW optimizer."""
    stages = {i: package.build_stage(i) for i in range(num_stages)}
    optimizers = {i: torch.optim.AdamW(m.parameters()) for i, m in stages.items()}
    return stages, optimizers


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def zoo_packages(tmp_path_factory):
    """The architecture zoo (tests/zoo/models.py), each compiled into 2 stages once per session
    when first asked for (test_device_consistency, test_zoo)."""
    return Packages(tmp_path_factory.mktemp("zoo"))


#: test files that share a session fixture too costly to build twice (the zoo's packages)
_TOGETHER = {"test_zoo": "zoo", "test_device_consistency": "zoo"}


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``-n N --dist loadgroup``, the README's test command), each file's
    tests run in one worker, as its module fixtures are built once, and the files that share
    the zoo's packages in the same one."""
    for item in items:
        module = item.module.__name__ if item.module is not None else item.nodeid
        item.add_marker(pytest.mark.xdist_group(_TOGETHER.get(module, module)))
