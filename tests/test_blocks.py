"""Blocks as real submodules of the generated stages (issue 13): at their original names, called
once per stage forward, one generated class per block structure, shardable with FSDP2, and the
stage code a fraction of the inline code's length."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import models
from autopipe.codegen import package_files
from autopipe.compiler import CompileOptions, compile_spec
from autopipe.runtime.options import parse_config
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model, spec, torchrun_env
from models import gpt2
from pipelines import (
    STEPS,
    assert_same_training,
    capacity_needing_recomputation,
    reference_training,
    run_pipeline,
)


@pytest.fixture(scope="module")
def gpt2_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("blocks") / "gpt2"
    compile_model("gpt2", out, 2)
    return out


def run_stages(package, stages, inputs: dict) -> dict:
    """Each stage once on the model's inputs, the values relayed as the pipeline does."""
    values = dict(inputs)
    for stage, spec_ in zip(stages, package.PIPELINE["stages"]):
        outputs = stage(*[values[name] for name in spec_["inputs"]])
        values.update(zip(spec_["outputs"], outputs))
    return values


def test_whole_blocks_are_submodules_called_once_per_stage_forward(gpt2_package):
    from transformers import GPT2LMHeadModel

    package = load_pipeline(gpt2_package)
    stages = [package.build_stage(i) for i in range(len(package.PIPELINE["stages"]))]
    original, (ids,), kwargs = gpt2()
    assert isinstance(original, GPT2LMHeadModel)
    blocks, calls = {}, {}
    for stage in stages:
        held = set(stage.state_dict())
        for index in range(len(original.transformer.h)):
            fqn = f"transformer.h.{index}"
            own = {f"{fqn}.{name}" for name in original.transformer.h[index].state_dict()}
            if own <= held:  # all its state in this stage: the contract's block
                block = stage.get_submodule(fqn)
                blocks[fqn] = block
                calls[fqn] = 0
                block.register_forward_hook(lambda *_, fqn=fqn: calls.update({fqn: calls[fqn] + 1}))
                assert set(f"{fqn}.{k}" for k in block.state_dict()) == own
    assert len(blocks) >= 2
    run_stages(package, stages, {"input_ids": ids, **kwargs})
    assert calls == {fqn: 1 for fqn in blocks}
    # identical blocks are instances of one generated class, from the package's blocks.py
    classes = {type(b) for b in blocks.values()}
    assert len(classes) == 1 and next(iter(classes)).__name__ == "GPT2Block"
    assert next(iter(classes)).__module__.endswith(".blocks")
    # state names are the original model's
    assert set().union(*(s.state_dict().keys() for s in stages)) <= set(original.state_dict())


def test_fully_shard_one_block_trains_exactly_on_two_ranks(gpt2_package):
    package = load_pipeline(gpt2_package)
    stage0 = package.build_stage(0)
    fqn = next(f"transformer.h.{i}" for i in range(3) if _has(stage0, f"transformer.h.{i}"))
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "tests" / "fsdp_block.py"), str(gpt2_package), fqn,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env=torchrun_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert f"fully_shard({fqn}): 3 steps exact on 2 ranks" in result.stdout


def _has(stage, fqn) -> bool:
    try:
        stage.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def test_stage_code_of_a_24_layer_model_is_a_quarter_of_inline_code(tmp_path):
    """GPT-2 with 24 layers, built on meta, in 8 stages: stage files and blocks.py together at
    most a quarter of the lines of the same pipeline generated inline."""
    result = compile_spec(
        "tests/models.py:gpt2_meta_24", tmp_path / "p", CompileOptions(stages=8), report=False
    )
    structured = package_files(result.graph, result.partition)
    result.graph.model = result.graph.model.updated(inline_blocks=True)
    inline = package_files(result.graph, result.partition)

    def lines(files):
        return sum(
            text.count("\n")
            for name, text in files.items()
            if name.startswith("stage") or name == "blocks.py"
        )

    assert "blocks.py" in structured and "blocks.py" not in inline
    assert structured["blocks.py"].count("(Block):") == 1  # one class for the 24 layers
    assert lines(structured) * 4 <= lines(inline), (lines(structured), lines(inline))


def test_recompute_choices_name_stages_or_blocks(gpt2_package):
    pipeline = Pipeline.from_json(load_pipeline(gpt2_package).PIPELINE)
    blocks = [fqn for stage in pipeline.stages for fqn in stage.blocks]
    assert blocks == [f"transformer.h.{i}" for i in range(3)]  # whole blocks, in program order

    def choice(value):
        config = parse_config(["--recompute", value], pipeline)
        return config.recompute, config.recompute_blocks

    assert choice("blocks") == (frozenset(), frozenset(blocks))
    assert choice("blocks/2") == (frozenset(), frozenset(blocks[::2]))
    assert choice("blocks:1") == (frozenset(), frozenset(pipeline.stages[1].blocks))
    assert choice("0") == (frozenset({0}), frozenset())
    for bad in ("blocks/0", "blocks:7", "blocks/x", "layers"):
        with pytest.raises(SystemExit):
            choice(bad)


# Blocks recomputed in backward train like PyTorch below (the partitioner's choice) and, with
# torch.compile'd stages and FSDP2, in test_data_parallel.py (test_compiled_sharded_stages).


@pytest.mark.slow
def test_partitioner_recomputes_the_cheapest_blocks_and_train_follows(tmp_path):
    """A device too small for any split without recomputation: the partition recomputes blocks,
    not whole stages, and train.py (--recompute auto) trains exactly like PyTorch with them."""
    from autopipe.profiling import device_spec

    roomy = compile_model("gpt2", tmp_path / "roomy", 2)
    spec_file = tmp_path / "small.json"
    memory = capacity_needing_recomputation(roomy, "1f1b", whole_stages=False)
    small = device_spec("h100").to_json() | {"name": "small", "memory": memory}
    spec_file.write_text(json.dumps(small))
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_batch", device_spec=str(spec_file))
    pipeline = Pipeline.from_json(load_pipeline(tmp_path / "pipe").PIPELINE)
    assert pipeline.recomputed_blocks and not pipeline.recomputed
    assert pipeline.recomputed_blocks < {b for s in pipeline.stages for b in s.blocks}
    reference = reference_training(
        load_example(spec("gpt2")), models.gpt2_batch, STEPS, "adamw", 1e-3
    )
    assert_same_training(pipe, reference)


def test_compiled_stage_calls_each_block_once_and_matches_eager(gpt2_package):
    """train.py's --compile: the stage compiled whole, its blocks as nested compile regions; hooks
    on each block still fire once per forward, and outputs and gradients match eager."""
    import torch

    from autopipe.runtime.driver import compile_stage

    package = load_pipeline(gpt2_package)
    pipeline = Pipeline.from_json(package.PIPELINE)
    stage_spec = pipeline.stages[0]
    assert len(stage_spec.blocks) >= 2
    eager, compiled = package.build_stage(0), package.build_stage(0)
    compile_stage(compiled, stage_spec.blocks, frozenset())
    calls = {fqn: 0 for fqn in stage_spec.blocks}
    for fqn in stage_spec.blocks:
        compiled.get_submodule(fqn).register_forward_hook(
            lambda *_, fqn=fqn: calls.update({fqn: calls[fqn] + 1})
        )
    _, (ids,), kwargs = gpt2()
    inputs = {"input_ids": ids, **kwargs}
    results = []
    for stage in (eager, compiled):
        outputs = stage(*[inputs[name] for name in stage_spec.inputs])
        sum(o.float().pow(2).mean() for o in outputs if o.requires_grad).backward()
        results.append((outputs, {n: p.grad for n, p in stage.named_parameters()}))
    assert calls == {fqn: 1 for fqn in stage_spec.blocks}
    (eager_out, eager_grads), (compiled_out, compiled_grads) = results
    for a, b in zip(eager_out, compiled_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
