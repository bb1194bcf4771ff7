"""Generated code puts every tensor it makes on its stage's device: each stage of the committed
gallery (generated/) and of the architecture zoo runs forward and backward on a fake CUDA device,
in fp32 and under bf16 autocast, in this process (fake tensors: shapes and devices, no data; an
operator that mixes devices raises). A tensor made on another device fails the test naming the
generated line that made it and the one that mixed it (``runtime/dry_run.py``'s Rehearsal, under
the Fakes a torch without CUDA needs, as ``train.py --dry-run`` runs them).

The zoo's packages are the ones test_zoo checks against the models (compiled once per session).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.dry_run import Fakes, Rehearsal, generated_line
from autopipe.verify import load_pipeline

from conftest import ROOT
from zoo.models import ZOO

GALLERY = sorted(p.name for p in (ROOT / "generated").iterdir() if (p / "pipeline.json").is_file())
#: stages that compute a size from tensor values (``nonzero``), which fake tensors have not:
#: they run up to that operator, which must be the one named
DATA_DEPENDENT = {("deberta_v2", 1): "aten.nonzero.default"}
DEVICE = torch.device("cuda", 0)


def fake_passes(package_dir: Path, bf16: bool) -> dict[int, str]:
    """Each stage of the package, built on the fake CUDA device and run forward (under bf16
    autocast with ``bf16``) and backward from its floating outputs: stage -> its problem, with
    the generated line it happened at (none for a stage that passes)."""
    package_dir = package_dir.resolve()
    package = load_pipeline(package_dir)
    pipeline = Pipeline.from_json(package.PIPELINE)
    problems = {}
    with Fakes("cuda", 0, 1) as fakes:
        for stage in pipeline.stages:
            mode = Rehearsal(DEVICE, fakes.cpu_only_torch, package_dir)
            try:
                with FakeTensorMode(allow_non_fake_inputs=True), mode:
                    module = package.build_stage(stage.index, device=DEVICE)
                    inputs = []
                    for value in pipeline.taken(stage):
                        meta = value.meta_tensor()
                        tensor = torch.zeros(meta.shape, dtype=meta.dtype, device=DEVICE)
                        inputs.append(tensor.requires_grad_(meta.requires_grad))
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                        outputs = module(*inputs)
                    trained = [o for o in outputs if o.requires_grad]
                    assert trained, f"stage {stage.index} returns nothing to backpropagate"
                    torch.stack([o.float().sum() for o in trained]).sum().backward()
                    made = {p.grad.device for p in module.parameters() if p.grad is not None}
                    assert made == {DEVICE}, f"stage {stage.index}'s gradients are on {made}"
            except Exception as exc:  # noqa: BLE001 - reported with the generated line
                line = generated_line(exc, package_dir)
                problems[stage.index] = f"{type(exc).__name__}: {exc}" + (
                    f"\n  at {line}" if line else ""
                )
    return problems


def assert_consistent(name: str, package_dir: Path, bf16: bool) -> None:
    problems = fake_passes(package_dir, bf16)
    for (model, stage), operator in DATA_DEPENDENT.items():
        if model == name and stage in problems:
            assert problems.pop(stage).startswith(f"DataDependentSize: {operator}")
    assert not problems, "\n".join(f"stage {s}: {p}" for s, p in problems.items())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", GALLERY)
def test_gallery_stages_keep_to_the_device(name, bf16):
    assert_consistent(name, ROOT / "generated" / name, bf16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_stages_keep_to_the_device(zoo_packages, name, bf16):
    assert_consistent(name, zoo_packages.get(name), bf16)


def test_a_tensor_made_on_the_cpu_is_named(tmp_path):
    """A tensor the generated code makes on the CPU in a CUDA stage fails the stage, naming the
    line that made it and the line that mixed it with the stage's tensors."""
    package = tmp_path / "gpt2_4"
    shutil.copytree(ROOT / "generated" / "gpt2_4", package)
    source = (package / "stage0.py").read_text().splitlines(keepends=True)
    made = next(i for i, line in enumerate(source) if "aten.arange.default(" in line)
    source[made] = source[made].replace("device=device", 'device="cpu"')
    (package / "stage0.py").write_text("".join(source))
    problems = fake_passes(package, bf16=False)
    assert set(problems) == {0}, problems  # the other stages are untouched
    assert "DeviceMismatch: " in problems[0] and "mixes cpu and cuda:0" in problems[0]
    assert f"made at stage0.py:{made + 1}: " in problems[0], problems[0]
    assert "\n  at stage0.py:" in problems[0]  # the operator that mixed them
