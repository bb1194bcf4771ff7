"""The layout of a generated package, exactly as the contract of the end-to-end issue states it."""

from __future__ import annotations

import ast
import inspect
import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, spec


@pytest.fixture(scope="module", params=["gpt2", "multi_io", "t5"])
def compiled(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name) / "pipe"
    compile_model(name, out, 3)
    return name, out


def test_pipeline_description(compiled):
    name, out = compiled
    example = load_example(spec(name))
    pipeline = load_pipeline(out).PIPELINE
    json.dumps(pipeline)  # JSON-compatible
    assert pipeline == json.loads((out / "pipeline.json").read_text())
    assert Pipeline.from_json(pipeline).to_json() == pipeline  # the typed contract reads it all
    # inputs: forward's parameter names of the example's tensors
    bound = inspect.signature(example.model.forward).bind(*example.args, **example.kwargs).arguments
    assert pipeline["inputs"] == [k for k, v in bound.items() if isinstance(v, torch.Tensor)]
    # outputs: one name per tensor leaf of the model's output, in tree_leaves order
    leaves = [
        x
        for x in pytree.tree_leaves(example.model(*example.args, **example.kwargs))
        if isinstance(x, torch.Tensor)
    ]
    assert len(pipeline["outputs"]) == len(leaves)
    if name == "multi_io":
        assert pipeline["outputs"] == ["logits", "hidden", "score"]
    if name == "gpt2":
        assert pipeline["outputs"] == ["loss", "logits"]
    # stages: each input is a model input or an output of an earlier stage
    available = set(pipeline["inputs"])
    for stage in pipeline["stages"]:
        assert set(stage["inputs"]) <= available
        assert isinstance(stage["device"], int)
        available |= set(stage["outputs"])
    assert pipeline["stages"][-1]["outputs"] == pipeline["outputs"]
    # relaying: stage i receives only what stage i - 1 returns; a model input it reads (labels)
    # comes from the batch on its own rank (its data_inputs), not through the stages between
    for before, after in zip(pipeline["stages"], pipeline["stages"][1:]):
        read = after.get("data_inputs", [])
        assert set(read) <= set(pipeline["inputs"])
        assert [n for n in after["inputs"] if n not in read] == before["outputs"]
        assert not set(read) & set(before["outputs"])


def test_build_stage_state_names(compiled):
    name, out = compiled
    model = load_example(spec(name)).model
    package = load_pipeline(out)
    original_state = set(model.state_dict())
    original_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    held = set()
    for i in range(len(package.PIPELINE["stages"])):
        stage = package.build_stage(i, device="cpu")
        assert isinstance(stage, torch.nn.Module)
        keys = set(stage.state_dict())
        params = {n for n, _ in stage.named_parameters()}
        assert keys <= original_state, keys - original_state
        assert params <= original_params
        held |= params
    canonical = {n for n, _ in model.named_parameters()}  # tied weights: one name per tensor
    tied = [set(g) for g in package.PIPELINE["aliases"]]
    for n in canonical:
        assert n in held or any(n in g and g & held for g in tied), f"{n} is held by no stage"


def test_stage_call_convention(compiled):
    name, out = compiled
    example = load_example(spec(name))
    package = load_pipeline(out)
    pipeline = package.PIPELINE
    env = dict(zip(pipeline["signature"], example.args)) | example.kwargs
    for i, stage_spec in enumerate(pipeline["stages"]):
        stage = package.build_stage(i)
        result = stage(*[env[n] for n in stage_spec["inputs"]])
        assert isinstance(result, tuple) and len(result) == len(stage_spec["outputs"])
        assert all(isinstance(t, torch.Tensor) for t in result)
        env.update(zip(stage_spec["outputs"], result))


def test_tied_parameter_held_under_local_names(tmp_path):
    compile_model("gpt2", tmp_path / "pipe", 3)
    package = load_pipeline(tmp_path / "pipe")
    first = set(package.build_stage(0).state_dict())
    last = set(package.build_stage(2).state_dict())
    assert "transformer.wte.weight" in first
    assert "lm_head.weight" in last
    (tie,) = package.PIPELINE["tied"]
    assert set(tie["names"]) == {"transformer.wte.weight", "lm_head.weight"}
    assert tie["holders"] == {"0": "transformer.wte.weight", "2": "lm_head.weight"}
    # autopipe's own initialisation gives both copies the same values
    assert torch.equal(
        package.build_stage(0).get_parameter("transformer.wte.weight"),
        package.build_stage(2).get_parameter("lm_head.weight"),
    )


def test_package_needs_only_torch(compiled):
    _, out = compiled
    stdlib = set(sys.stdlib_module_names)
    for path in out.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [] if node.level else [node.module.split(".")[0]]
                if (
                    path.name == "train.py"
                    and node.module
                    and node.module.startswith("autopipe_pipeline")
                ):
                    roots = []  # the package itself, loaded by path
            else:
                continue
            for root in roots:
                assert root == "torch" or root in stdlib, f"{path.name} imports {root}"


def test_importable_from_any_path(compiled, tmp_path):
    _, out = compiled
    copy = tmp_path / "elsewhere" / "my_pipeline"
    shutil.copytree(out, copy)
    code = (
        "import my_pipeline, torch; "
        "s = my_pipeline.build_stage(0); "
        "print(len(my_pipeline.PIPELINE['stages']), type(s).__name__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=copy.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "Stage0"]


def test_generated_code_is_formatted_and_commented(compiled):
    import black

    from autopipe.codegen.package import BLACK_MODE

    _, out = compiled
    stage = (out / "stage1.py").read_text()
    assert black.format_str(stage, mode=BLACK_MODE) == stage
    blocks = (out / "blocks.py").read_text() if (out / "blocks.py").exists() else ""
    assert "# " in stage and "aten." in stage + blocks
    comments = [line.strip() for line in stage.splitlines() if line.strip().startswith("# ")]
    assert any("(" in c and ")" in c for c in comments)  # "# transformer.h.1.attn (GPT2Attention)"
    assert str(out) not in stage and "/tmp" not in stage
