"""Bad input gets a clear error naming the problem and the fix, and nothing is lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from autopipe.cli import main as autopipe
from autopipe.compiler import CompileOptions, compile_spec
from autopipe.errors import (
    ArtifactError,
    OutputExistsError,
    PartitionError,
    SpecError,
    TraceError,
    WriteError,
)
from autopipe.ir import Graph
from autopipe.profiling.profile import Profile
from autopipe.spec import load_example
from autopipe.verify import verify

from conftest import compile_model, spec


def test_spec_file_missing():
    with pytest.raises(SpecError, match="nowhere.py.*does not exist"):
        load_example("nowhere.py:build")


def test_spec_function_missing():
    with pytest.raises(SpecError, match="has no function 'nope'.*callables there: .*gpt2"):
        load_example(spec("nope"))


def test_spec_without_function():
    with pytest.raises(SpecError, match="FILE.py:FUNCTION or package.module:FUNCTION"):
        load_example("tests/models.py")


def test_spec_module_missing():
    with pytest.raises(SpecError, match="cannot import module 'no_such_package.models'"):
        load_example("no_such_package.models:build")


def test_spec_returns_wrong_type():
    with pytest.raises(SpecError, match="first item must be a torch.nn.Module, got a str"):
        load_example(spec("not_a_model"))


def test_spec_returns_wrong_shape(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("def build():\n    return 42\n")
    with pytest.raises(SpecError, match=r"returned a int; it must return \(model, args\)"):
        load_example(f"{module}:build")


def test_package_module_spec():
    example = load_example("tests.models:mlp")
    assert example.model.__class__.__name__ == "SkipMLP"


def test_more_stages_than_units(tmp_path):
    with pytest.raises(PartitionError, match="8 stages need at least 8 units, but the graph has 7"):
        compile_model("multi_io", tmp_path / "out", 8)
    assert not (tmp_path / "out").exists()


def test_data_dependent_control_flow_names_user_line(tmp_path):
    with pytest.raises(TraceError) as info:
        compile_model("branchy", tmp_path / "out", 2)
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert "tests/models.py:" in message and "if h.sum() > 0:" in message
    assert "torch.where" in message and "fixed (non-tensor) input" in message
    assert "torch.cond(pred, true_fn, false_fn, (operands,))" in message
    line = next(i for i, text in enumerate(open("tests/models.py"), 1) if "if h.sum() > 0:" in text)
    assert f"models.py:{line}" in message


def test_untraceable_operation(tmp_path):
    module = tmp_path / "numpy_model.py"
    module.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.from_numpy(x.numpy() * 2)\n"
        "def build():\n"
        "    return M(), (torch.randn(2, 3),)\n"
    )
    with pytest.raises(TraceError, match=r"numpy_model.py:4"):
        compile_spec(f"{module}:build", tmp_path / "out", CompileOptions(stages=1))


def test_existing_output_dir_refused(tmp_path):
    out = tmp_path / "out"
    compile_model("mlp", out, 2)
    before = _files(out)
    with pytest.raises(OutputExistsError, match="already exists; pass --force"):
        compile_model("mlp", out, 3)
    assert _files(out) == before
    compile_model("mlp", out, 3, force=True)
    assert (out / "stage2.py").exists()


def _files(directory):
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_failed_generation_leaves_nothing_half_written(tmp_path, monkeypatch):
    from autopipe.codegen import package

    out = tmp_path / "out"
    compile_model("mlp", out, 2)
    before = _files(out)
    original = package.Path.write_text
    calls = []

    def failing_write(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 4:
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(package.Path, "write_text", failing_write)
    with pytest.raises(WriteError, match=f"cannot write {out}: disk full .*{out} is unchanged"):
        compile_spec(spec("mlp"), out, CompileOptions(stages=3), force=True)
    monkeypatch.undo()
    assert _files(out) == before  # old pipeline intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary leftovers


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert autopipe(["compile", spec("nope"), "--stages", "2", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopipe compile: error:") and "Traceback" not in err


def test_corrupted_and_foreign_artifacts(tmp_path):
    bad = tmp_path / "graph.json"
    bad.write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Graph.load(bad)
    bad.write_text(json.dumps({"format": "autopipe.profile", "version": 1}))
    with pytest.raises(
        ArtifactError, match="expected an autopipe.graph artefact, found 'autopipe.profile'"
    ):
        Graph.load(bad)
    bad.write_text(json.dumps({"format": "autopipe.graph", "version": 99}))
    with pytest.raises(ArtifactError, match="version 99 cannot be read"):
        Graph.load(bad)


def test_profile_of_another_graph(tmp_path):
    assert autopipe(["trace", spec("mlp"), "-o", str(tmp_path / "a.json")]) == 0
    assert autopipe(["trace", spec("mlp"), "--depth", "1", "-o", str(tmp_path / "b.json")]) == 0
    assert autopipe(["profile", str(tmp_path / "a.json"), "-o", str(tmp_path / "p.json")]) == 0
    with pytest.raises(ArtifactError, match="profile was made for a different graph"):
        Profile.load(tmp_path / "p.json").check_graph(Graph.load(tmp_path / "b.json"))


def test_unknown_basic_block(tmp_path):
    with pytest.raises(TraceError, match="GPT2Blok match no module.*GPT2Block"):
        compile_model("gpt2", tmp_path / "o", 2, basic_blocks=("GPT2Blok",))


def _train(out, nproc, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(out / "train.py"),
        "--device",
        "cpu",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_runtime_errors(tmp_path):
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    result = _train(out, 1, "--steps", "1")
    assert result.returncode != 0
    assert (
        "this pipeline runs on 2 ranks" in result.stderr and "--nproc-per-node=2" in result.stderr
    )
    # a batch of the wrong size: tests/test_failures.py (its wording, and how ranks print it)
    result = subprocess.run(
        [sys.executable, str(out / "train.py"), "--schedule", "1f1b", "--microbatches", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        result.returncode == 2
        and "1f1b needs at least as many microbatches as stages (2)" in result.stderr
    )


def test_hand_edited_package_is_reported(tmp_path, capsys):
    """manifest.json holds every generated file's hash: `autopipe verify DIR` (files only) and
    `verify DIR --spec` name the edited, deleted and added files and fail."""
    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    assert autopipe(["verify", str(out)]) == 0
    assert "the pipeline is as generated" in capsys.readouterr().out
    stage = out / "stage1.py"
    stage.write_text(stage.read_text() + "# a hand edit\n")
    (out / "runtime" / "core" / "schedules.py").unlink()
    (out / "stage9.py").write_text("# mine\n")
    with pytest.raises(SystemExit) as exc:
        autopipe(["verify", str(out)])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "edited since generation (3 files" in printed
    for rel in ("stage1.py", "runtime/core/schedules.py", "stage9.py"):
        assert f"  {rel}\n" in printed
    with pytest.raises(SystemExit):
        autopipe(["verify", str(out), "--spec", spec("mlp")])
    assert "stage1.py" in capsys.readouterr().out


def test_custom_autograd_function_refused(tmp_path):
    """A custom Function runs its own forward and backward in the pipeline, traced into torch
    operators (tests/test_functions.py); one whose backward cannot be traced (a Python branch
    on tensor values here) is refused, naming the function, the user's line and the reason,
    rather than trained with another gradient."""
    module = tmp_path / "custom_fn.py"
    module.write_text(
        "import torch\n"
        "class Triple(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x):\n"
        "        ctx.save_for_backward(x)\n"
        "        return x * 2\n"
        "    @staticmethod\n"
        "    def backward(ctx, grad):\n"
        "        (x,) = ctx.saved_tensors\n"
        "        return grad * 3 if x.sum() > 0 else grad\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.b(Triple.apply(self.a(x))).sum()\n"
        "def build():\n"
        "    return M(), (torch.randn(2, 4),)\n"
    )
    with pytest.raises(TraceError) as caught:
        compile_spec(f"{module}:build", tmp_path / "out", CompileOptions(stages=2))
    message = str(caught.value)
    assert re.search(r"custom autograd function Triple at .*custom_fn.py:16", message), message
    assert "cannot reproduce its backward" in message, message
    assert re.search(r"depends on tensor values .*custom_fn.py:10", message), message
    assert not (tmp_path / "out").exists()
    assert torch.autograd.Function.apply.__func__.__module__ == "torch.autograd.function"


def test_torch_cond_compiles(tmp_path):
    """torch.cond, which the data-dependent control flow error recommends, compiles: the pipeline
    matches the model on inputs taking either branch (tests/test_control_flow.py has more)."""
    module = tmp_path / "cond_model.py"
    module.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        h = torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,))\n"
        "        return self.b(h).sum()\n"
        "def build(scale=100.0):\n"
        "    torch.manual_seed(0)\n"
        "    return M(), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)) * scale,)\n"
        "def other():\n"
        "    return build(-100.0)\n"
    )
    out = tmp_path / "out"
    compile_spec(f"{module}:build", out, CompileOptions(stages=2), report=False)
    source = (out / "stage0.py").read_text() + (out / "stage1.py").read_text()
    assert "torch.cond(" in source and "# true branch of torch.cond at cond_model.py:8" in source
    taken = set()
    for name in ("build", "other"):
        example = load_example(f"{module}:{name}")
        taken.add(bool(example.model.a(*example.args).sum() > 0))
        report = verify(out, example)
        assert report.ok, report.summary()
    assert taken == {True, False}
