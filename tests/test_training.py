"""Multi-process training on gloo ranks matches plain single-process PyTorch."""

from __future__ import annotations

import json

import pytest
import torch

import models
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, run_ranks_together, spec
from pipelines import MICROBATCHES, STEPS, assert_same_training, reference_training, run_pipeline


@pytest.mark.slow
@pytest.mark.parametrize(
    "stages,schedule,optimizer,built",
    [(2, "gpipe", "adamw", "gpt2_meta"), (3, "1f1b", "sgd", "gpt2")],
    ids=["2-gpipe-adamw-compiled-on-meta", "3-1f1b-sgd"],
)
def test_gpt2_tied_weights(tmp_path, stages, schedule, optimizer, built):
    """GPipe on 2 ranks and 1F1B on 3 train like PyTorch, the tied embedding and output layer
    stay one tensor; the first package is compiled from the model built on the meta device
    (no weights) and trains the real weights given with --load."""
    lr = 1e-3 if optimizer == "adamw" else 0.1
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        stages,
        "gpt2_batch",
        "--schedule",
        schedule,
        "--optimizer",
        optimizer,
        "--lr",
        str(lr),
        compile_spec=built,
    )
    ref = reference_training(load_example(spec("gpt2")), models.gpt2_batch, STEPS, optimizer, lr)
    assert_same_training(pipe, ref)
    # the tied copies stayed equal, and the saved state_dict loads into the original model
    assert torch.equal(pipe[1]["lm_head.weight"], pipe[1]["transformer.wte.weight"])
    load_example(spec("gpt2")).model.load_state_dict(pipe[1])


# The BatchNorm CNN with a user loss trains against PyTorch on 2 ranks in test_runtime.py
# (test_recomputation_keeps_results_and_batchnorm_statistics), and with SGD on 4 stages below.


@pytest.mark.slow
def test_synthetic_data_and_defaults(tmp_path):
    """No --data, no --load: synthetic batches and autopipe's initialisation; the run is
    deterministic for a seed."""
    out = tmp_path / "pipe"
    compile_model("bert", out, 2)
    runs = [tmp_path / f"log{run}.jsonl" for run in range(2)]
    run_ranks_together(
        *((out / "train.py", 2, ["--steps", "3", "--microbatches", "2", "--log-json", str(log)])
          for log in runs)
    )  # fmt: skip
    logs = [[json.loads(line)["loss"] for line in log.read_text().splitlines()] for log in runs]
    assert len(logs[0]) == 3 and all(l == l and l > 0 for l in logs[0])  # finite, positive
    assert logs[0] == logs[1]


# Every partitioning method's stages are checked against the model in-process
# (test_equivalence.py::test_every_method_matches_model); training on as many ranks as stages is
# test_runtime.py's (every schedule, 1F1B on 3 ranks among them).


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,method,schedule",
    [
        ("gpt2", "mpipe", None),
        ("cnn", "mpipe", None),
    ],
)
def test_more_stages_than_devices(tmp_path, name, method, schedule):
    """4 stages on 2 ranks: several stages per rank, run by autopipe's order through torch's
    schedule runtime (Mixed-Pipe placements). torch's multi-stage schedules on looped placements
    are test_runtime.py's (test_every_schedule_trains_like_pytorch)."""
    extra = ("--schedule", schedule) if schedule else ()
    if name == "gpt2":
        pipe = run_pipeline(tmp_path, "gpt2", 4, "gpt2_batch", *extra, devices=2, method=method)
        ref = reference_training(
            load_example(spec("gpt2")), models.gpt2_batch, STEPS, "adamw", 1e-3
        )
    else:
        pipe = run_pipeline(
            tmp_path,
            "cnn",
            4,
            "cnn_batch",
            *extra,
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            devices=2,
            method=method,
            loss="tests/models.py:cross_entropy",
            train_spec="cnn_with_target",
        )
        ref = reference_training(
            load_example(spec("cnn_with_target")),
            models.cnn_batch,
            STEPS,
            "sgd",
            0.05,
            models.cross_entropy,
        )
    assert_same_training(pipe, ref)
    assert len(load_pipeline(tmp_path / "pipe").PIPELINE["stages"]) == 4
    if name == "cnn":  # BatchNorm's statistics counted once per microbatch, as in PyTorch
        assert int(pipe[1]["features.1.num_batches_tracked"]) == STEPS * MICROBATCHES


@pytest.mark.slow
def test_encoder_decoder_fan_out_on_fewer_devices(tmp_path):
    """T5's encoder output feeds every decoder layer: relayed through 4 stages on 2 ranks."""
    pipe = run_pipeline(tmp_path, "t5", 4, "t5_batch", devices=2, method="mpipe")
    ref = reference_training(load_example(spec("t5")), models.t5_batch, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_long_skips_with_metis(tmp_path):
    pipe = run_pipeline(
        tmp_path,
        "mlp",
        3,
        "mlp_batch",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        method="metis",
        loss="tests/models.py:mse",
        train_spec="mlp_with_target",
    )
    ref = reference_training(
        load_example(spec("mlp_with_target")), models.mlp_batch, STEPS, "sgd", 0.1, models.mse
    )
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_channels_last_layout_trains_like_pytorch(tmp_path):
    pipe = run_pipeline(
        tmp_path,
        "channels_last_with_target",
        3,
        "channels_last_batch",
        loss="tests/models.py:cross_entropy",
    )
    ref = reference_training(
        load_example(spec("channels_last_with_target")),
        models.channels_last_batch,
        STEPS,
        "adamw",
        1e-3,
        models.cross_entropy,
    )
    assert_same_training(pipe, ref)


def test_a_plain_loss_tensor_is_the_loss(tmp_path):
    """A forward that returns its loss as a plain scalar tensor (issue 41): the package takes
    that output as the loss (it was refused, "give it labels") and trains like PyTorch."""
    pipe = run_pipeline(tmp_path, "plain_loss", 2, "plain_loss_batch", "--lr", "1e-2")
    assert json.loads((tmp_path / "pipe" / "pipeline.json").read_text())["loss"] == {
        "output": "output"
    }
    ref = reference_training(
        load_example(spec("plain_loss")), models.plain_loss_batch, STEPS, "adamw", 1e-2
    )
    assert_same_training(pipe, ref)
