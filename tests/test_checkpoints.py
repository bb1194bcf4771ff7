"""--load reads torch.save files, .safetensors files and sharded Hugging Face directories, and a
rank reads only its own tensors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from autopipe.compiler import CompileOptions, compile_spec
from autopipe.runtime.checkpoint import Checkpoint, CheckpointError, save_safetensors
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.train_state import load_weights
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, spec


def write_checkpoint(state: dict, path, kind: str):
    """``state`` as a ``torch.save`` file, a ``.safetensors`` file, or a sharded directory."""
    if kind == "torch":
        torch.save(state, path / "model.pt")
        return path / "model.pt"
    if kind == "safetensors":
        save_safetensors(state, path / "model.safetensors")
        return path / "model.safetensors"
    shards = path / "checkpoint"
    shards.mkdir()
    names = list(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-{i + 1:05d}-of-00002.{'safetensors' if kind == 'sharded-safetensors' else 'bin'}"
        piece = {n: state[n] for n in part}
        (
            save_safetensors(piece, shards / shard)
            if kind == "sharded-safetensors"
            else torch.save(piece, shards / shard)
        )
        weight_map.update({n: shard for n in part})
    index = (
        "model.safetensors.index.json"
        if kind == "sharded-safetensors"
        else "pytorch_model.bin.index.json"
    )
    (shards / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


@pytest.mark.parametrize("kind", ["torch", "safetensors", "sharded-safetensors", "sharded-bin"])
def test_every_format_loads_each_stage_exactly(tmp_path, kind):
    compile_model("gpt2", tmp_path / "pipe", 3)
    package = load_pipeline(tmp_path / "pipe")
    state = load_example(spec("gpt2")).model.state_dict()
    # Hugging Face drops tied duplicates from its checkpoints: the aliases resolve them
    del state["lm_head.weight"]
    path = write_checkpoint(state, tmp_path, kind)
    stages = {i: package.build_stage(i, meta_state=True) for i in range(3)}
    assert all(p.is_meta for s in stages.values() for p in s.parameters())
    load_weights(stages, str(path), package.PIPELINE, torch.device("cpu"))
    for stage in stages.values():
        for name, tensor in stage.state_dict().items():
            expected = state["transformer.wte.weight" if name == "lm_head.weight" else name]
            assert not tensor.is_meta and torch.equal(tensor, expected), name
    assert all(p.requires_grad for s in stages.values() for p in s.parameters())
    # the tied embedding read by stages 0 and 2 of one rank: two tensors, never one storage twice
    first, last = stages[0].get_parameter("transformer.wte.weight"), stages[2].get_parameter(
        "lm_head.weight"
    )
    assert first.untyped_storage().data_ptr() != last.untyped_storage().data_ptr()


def test_wrong_checkpoints_are_named(tmp_path):
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    state = load_example(spec("mlp")).model.state_dict()
    stages = {0: package.build_stage(0, meta_state=True)}
    first = next(iter(stages[0].state_dict()))
    missing = dict(state)
    del missing[first]
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(PipelineRunError, match=f"has no entry '{first}'"):
        load_weights(stages, str(tmp_path / "missing.pt"), package.PIPELINE, torch.device("cpu"))
    wrong = dict(state)
    wrong[first] = torch.zeros(3)
    torch.save(wrong, tmp_path / "wrong.pt")
    with pytest.raises(PipelineRunError, match=f"{first} .* has shape \\[3\\], stage 0 expects"):
        load_weights(stages, str(tmp_path / "wrong.pt"), package.PIPELINE, torch.device("cpu"))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Checkpoint(tmp_path / "garbage.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")


def test_bf16_checkpoint_is_cast_to_the_stage_dtype(tmp_path):
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    state = {
        k: v.to(torch.bfloat16) for k, v in load_example(spec("mlp")).model.state_dict().items()
    }
    save_safetensors(state, tmp_path / "half.safetensors")
    stages = {0: package.build_stage(0, meta_state=True)}
    load_weights(stages, str(tmp_path / "half.safetensors"), package.PIPELINE, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in stages[0].parameters())


BIG = """
import torch
from torch import nn

class Tall(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(32))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

def build():
    torch.manual_seed(0)
    return Tall(), (torch.randn(2, 1024),)
"""

MEASURE = """
import sys, torch
sys.path.insert(0, {parent!r})
from autopipe.verify import load_pipeline
from autopipe.runtime.train_state import load_weights

def status(field):  # kB in /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

package = load_pipeline({pipe!r})
stage = package.build_stage({index}, meta_state=True)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current resident size
before = status("VmRSS:")
load_weights({{{index}: stage}}, {checkpoint!r}, package.PIPELINE, torch.device("cpu"))
for tensor in stage.state_dict().values():
    tensor.add_(0)  # read and write every page, as training does
size = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
print(status("VmHWM:") - before, size)
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 134 MB model of BIG compiled into 4 stages once: (its directory, the package)."""
    root = tmp_path_factory.mktemp("big")
    (root / "big.py").write_text(BIG)
    compile_spec(f"{root / 'big.py'}:build", root / "pipe", CompileOptions(stages=4), report=False)
    return root, root / "pipe"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "safetensors", "sharded-safetensors"])
def test_a_rank_reads_only_its_stage(big, tmp_path, kind):
    """Loading a 134 MB model into one of 4 stages, then touching every tensor, raises peak memory
    by that stage (34 MB: the pages of the mapped checkpoint it holds), not by the model."""
    root, pipe = big
    model = load_example(f"{root / 'big.py'}:build").model
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    checkpoint = write_checkpoint(model.state_dict(), tmp_path, kind)
    del model
    code = MEASURE.format(parent=str(root), pipe=str(pipe), index=1, checkpoint=str(checkpoint))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    grown, stage_bytes = map(int, result.stdout.split())
    assert stage_bytes < total / 3
    message = (
        f"peak grew {grown >> 20} MB for a {stage_bytes >> 20} MB stage of a {total >> 20} MB model"
    )
    assert stage_bytes * 0.9 < grown < 1.2 * stage_bytes + (8 << 20), message
