"""Every model input stays a pipeline input, whatever the example shares and whatever the model
reads (issue 12): checked through train.py with fresh data, not only with verify."""

from __future__ import annotations

import pytest

import models
from autopipe.compiler import CompileOptions, compile_spec
from autopipe.report.progress import NORMAL, Phases
from autopipe.spec import load_example
from autopipe.verify import verify

from conftest import compile_model, spec
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline


@pytest.mark.slow
def test_one_tensor_for_two_inputs_trains_with_other_labels(tmp_path):
    """The example passes `ids` as input_ids and labels; trained on batches whose labels differ
    from the ids, the pipeline equals PyTorch (a merged input would train on the ids)."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch_other_labels", compile_spec="gpt2_labels_are_ids"
    )
    # two inputs of the package: the ids in the first stage, the labels read by the last
    assert "def forward(self, input_ids):" in (tmp_path / "pipe" / "stage0.py").read_text()
    assert "def forward(self, labels, " in (tmp_path / "pipe" / "stage1.py").read_text()
    ref = reference_training(
        load_example(spec("gpt2")), models.gpt2_batch_other_labels, STEPS, "adamw", 1e-3
    )
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_an_input_the_model_ignores_is_accepted_and_dropped(tmp_path, capsys):
    compile_spec(
        spec("mask_ignored_with_target"),
        tmp_path / "said",
        CompileOptions(stages=2),
        loss="tests/models.py:mse",
        report=False,
        phases=Phases(NORMAL),
    )
    assert "does not read its input(s) mask" in capsys.readouterr().err
    pipe = run_pipeline(
        tmp_path,
        "mask_ignored_with_target",
        2,
        "mask_ignored_batch",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        loss="tests/models.py:mse",
    )
    ref = reference_training(
        load_example(spec("mask_ignored_with_target")),
        models.mask_ignored_batch,
        STEPS,
        "sgd",
        0.1,
        models.mse,
    )
    assert_same_training(pipe, ref)


def test_an_operator_from_another_module_is_imported_by_its_stage(tmp_path):
    """Called inside a torch.cond branch, the operator's module still reaches the stage's
    OPERATORS, which the stage imports when it is built."""
    compile_model("third_party_in_cond", tmp_path / "pipe", 2)
    stages = "".join(p.read_text() for p in sorted((tmp_path / "pipe").glob("stage*.py")))
    assert '"autopipe_test::twice": "custom_ops",' in stages
    assert "require_operators(OPERATORS)" in stages
    report = verify(tmp_path / "pipe", load_example(spec("third_party_in_cond")), rtol=0, atol=0)
    assert report.ok, report.summary()
