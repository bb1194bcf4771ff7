"""Checkpoints know their model (issue 26): a pipeline records its model's identity (every
tensor's name, shape and dtype, and a digest of the traced model), training checkpoints record
it, and a run refuses another model's checkpoints before it resumes, writes or prunes anything;
``--load`` takes a checkpoint holding more than the model only with ``--load-partial``. Packages
of the same model (another partition, another example batch) share the identity, so
checkpoints keep resharding between them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from autopipe.runtime import train_state
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import ModelIdentity, Pipeline
from autopipe.runtime.identity import identity_difference, tensors_difference
from autopipe.verify import load_pipeline

from conftest import ONE_PROCESS, compile_model, training_state


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """The 3-layer test GPT-2 in two partitions, and a 2-layer one (another model)."""
    root = tmp_path_factory.mktemp("identity")
    compile_model("gpt2", root / "three", 2)
    compile_model("gpt2", root / "three_in_3", 3)
    compile_model("gpt2_two_layers", root / "two", 2)
    return {name: root / name for name in ("three", "three_in_3", "two")}


def _pipeline(package: Path) -> Pipeline:
    return Pipeline.from_json(load_pipeline(package).PIPELINE)


def _checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _checkpoint(package: Path, root: Path, step: int, keep: int = 0) -> Path:
    """A training checkpoint of ``package``'s freshly built stages in ``root``."""
    stages, optimizers = training_state(load_pipeline(package), len(_pipeline(package).stages))
    checkpoints = train_state.TrainingCheckpoints(
        root, load_pipeline(package).PIPELINE, ONE_PROCESS, keep
    )
    return checkpoints.save(step, stages, optimizers)


def test_the_identity_lists_every_tensor_and_ignores_the_partition(packages):
    three, other_split, two = (_pipeline(packages[n]) for n in ("three", "three_in_3", "two"))
    assert three.identity is not None and two.identity is not None
    model, *_ = __import__("models").gpt2()
    state = model.state_dict()
    first_names = {group[0] for group in three.aliases} | set(state)
    assert set(three.identity.tensors) <= first_names
    assert {n for n in state if n != "lm_head.weight"} == set(three.identity.tensors)
    for name, (shape, dtype) in three.identity.tensors.items():
        assert list(shape) == list(state[name].shape) and dtype == "float32"
    assert other_split.identity == three.identity  # another partition: the same model
    assert two.identity.digest != three.identity.digest


def test_differences_name_the_first_tensor_on_either_side():
    ours = {"a": ((2,), "float32"), "b": ((3,), "float32")}
    assert tensors_difference(ours, dict(ours)) is None
    assert "it has no b" in tensors_difference(ours, {"a": ours["a"]})
    extra = tensors_difference(ours, {**ours, "c": ((1,), "float32"), "d": ((1,), "float32")})
    assert "it holds c and 1 more, which this model has not" in extra
    assert tensors_difference(ours, {**ours, "c": ((1,), "float32")}, partial=True) is None
    changed = tensors_difference(ours, {**ours, "b": ((4,), "bfloat16")})
    assert "b as bfloat16 [4], this model as float32 [3]" in changed
    same = ModelIdentity("d1", ours)
    assert identity_difference(same, ModelIdentity("d1", {})) is None  # the digest decides
    assert "module tree changed" in identity_difference(same, ModelIdentity("d2", dict(ours)))
    assert identity_difference(same, ModelIdentity("", dict(ours))) is None  # no digest: tensors


def test_another_models_checkpoints_are_refused_and_left_untouched(
    tmp_path, packages, single_process_group
):
    """Defect 1 of the issue, in process: the 2-layer model meets the 3-layer model's
    checkpoints. Nothing resumes, nothing is pruned or repointed, and the message names the
    first tensor that differs."""
    root = tmp_path / "ck"
    for step in (1, 2):
        _checkpoint(packages["three"], root, step)
    before = _checksums(root)
    kept = {k: v for k, v in before.items() if k.startswith("step-")}
    two = train_state.TrainingCheckpoints(
        root, load_pipeline(packages["two"]).PIPELINE, ONE_PROCESS, 1
    )
    with pytest.raises(PipelineRunError, match="holds checkpoints of another model") as caught:
        two.refuse_other_models()
    assert "it holds transformer.h.2." in str(caught.value)
    assert "own --checkpoint-dir" in str(caught.value)
    stages, optimizers = training_state(load_pipeline(packages["two"]), 2)
    with pytest.raises(PipelineRunError, match="holds another model than GPT2LMHeadModel"):
        two.restore(root / "step-00000002", stages, optimizers)
    assert _checksums(root) == before
    # pruning by a run of the 2-layer model (had it been let in) spares the other model's
    two.save(3, stages, optimizers)
    two.save(4, stages, optimizers)
    after = _checksums(root)
    assert {k: v for k, v in after.items() if k in kept} == kept
    assert sorted(p.name for p in root.glob("step-*")) == [
        "step-00000001",
        "step-00000002",
        "step-00000004",
    ]


def test_a_larger_model_is_refused_by_every_rank_before_it_loads(
    tmp_path, packages, single_process_group
):
    """Defect 2 of the issue: the larger model on the smaller one's checkpoints. The stage that
    needs the missing layers is not rank 0's, yet the refusal comes before any rank loads, from
    what every rank knows alike (the identities), naming the first missing tensor."""
    root = tmp_path / "ck"
    _checkpoint(packages["two"], root, 1)
    three = train_state.TrainingCheckpoints(
        root, load_pipeline(packages["three"]).PIPELINE, ONE_PROCESS, 0
    )
    with pytest.raises(PipelineRunError, match="it has no transformer.h.2.") as caught:
        three.refuse_other_models()
    assert caught.value.every_rank


def test_the_same_model_resumes_from_another_partition(tmp_path, packages, single_process_group):
    root = tmp_path / "ck"
    _checkpoint(packages["three"], root, 1)
    other = train_state.TrainingCheckpoints(
        root, load_pipeline(packages["three_in_3"]).PIPELINE, ONE_PROCESS, 0
    )
    other.refuse_other_models()
    stages, optimizers = training_state(load_pipeline(packages["three_in_3"]), 3)
    assert other.restore(root / "step-00000001", stages, optimizers) == 1


def test_checkpoints_written_before_identities_are_compared_by_their_tensors(
    tmp_path, packages, single_process_group
):
    """A version-2 checkpoint (no identity in its manifest) is told apart by the tensors DCP's
    metadata lists."""
    root = tmp_path / "ck"
    path = _checkpoint(packages["three"], root, 1)
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["version"] == 3 and "identity" in manifest
    del manifest["identity"]
    manifest["version"] = 2
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    same = train_state.TrainingCheckpoints(
        root, load_pipeline(packages["three_in_3"]).PIPELINE, ONE_PROCESS, 0
    )
    assert same.model_difference(path) is None
    other = train_state.TrainingCheckpoints(
        root, load_pipeline(packages["two"]).PIPELINE, ONE_PROCESS, 0
    )
    assert "it holds transformer.h.2." in other.model_difference(path)


def test_load_takes_a_larger_checkpoint_only_when_asked(tmp_path, packages):
    model, *_ = __import__("models").gpt2()
    path = tmp_path / "three.pt"
    torch.save(model.state_dict(), path)
    package = load_pipeline(packages["two"])
    stages = {i: package.build_stage(i, meta_state=True) for i in range(2)}
    with pytest.raises(PipelineRunError, match="--load-partial") as caught:
        train_state.load_weights(stages, str(path), package.PIPELINE, torch.device("cpu"))
    assert "transformer.h.2." in str(caught.value)
    left_out = train_state.load_weights(
        stages, str(path), package.PIPELINE, torch.device("cpu"), partial=True
    )
    assert left_out == sum(1 for name in model.state_dict() if ".h.2." in name)
    assert torch.equal(
        stages[0].state_dict()["transformer.wte.weight"],
        model.state_dict()["transformer.wte.weight"],
    )
