"""Each input's batch dimension (issue 42, item 3): found by the trace where an input goes
straight into a torch RNN, given or overridden by ``--batch-dims``, recorded in ``pipeline.json``
(``batch_dims``) and honoured by everything in train.py that splits or sizes a batch.

One package (the time-first LSTM of tests/models.py, in 2 stages) serves every test here."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

import models
from autopipe.compiler import trace_step
from autopipe.errors import AutopipeError
from autopipe.options import BatchDims, CompileOptions
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline, PipelineFormatError
from autopipe.runtime.data import Batches
from autopipe.runtime.driver import chunk_spec
from autopipe.runtime.options import parse_config
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, spec
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline
from test_dry_run import play, problems

NAME, BATCHES, LOSS = "time_first_lstm", "time_first_lstm_batch", "tests/models.py:mse"
#: what the trace finds for the time-first LSTM: the sequence and both initial states
FOUND = {"x": 1, "h0": 1, "c0": 1}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The time-first LSTM compiled into 2 stages with no flag: its directory."""
    out = tmp_path_factory.mktemp("time_first") / "pipe"
    compile_model(NAME, out, 2, loss=LOSS)
    return out


@pytest.fixture(scope="module")
def pipeline(package) -> Pipeline:
    return Pipeline.from_json(json.loads((package / "pipeline.json").read_text()))


@pytest.mark.slow
def test_a_time_first_lstm_given_its_state_trains_like_pytorch(package, tmp_path):
    """No flag at compile or train time: the package records the batch dimensions the trace
    shows, and train.py (2 ranks, 4 microbatches, a held-out evaluation) trains as PyTorch does
    splitting every input along dimension 1."""
    assert json.loads((package / "pipeline.json").read_text())["batch_dims"] == FOUND
    pipe = run_pipeline(
        tmp_path, NAME, 2, BATCHES, "--optimizer", "sgd", "--lr", "0.1",
        "--eval-data", f"tests/models.py:{BATCHES}", "--eval-batches", "1", "--eval-every", "2",
        package=package,
    )  # fmt: skip
    example = load_example(spec(NAME))
    ref = reference_training(
        example, models.time_first_lstm_batch, STEPS, "sgd", 0.1, models.mse, batch_dims=FOUND
    )
    assert_same_training(pipe, ref)
    # the last evaluation (of held-out batch 0, after the last step): the trained model's mean
    # microbatch loss, each microbatch 2 sequences along dimension 1
    (x, h0, c0), _, target = models.time_first_lstm_batch(0)
    with torch.no_grad():
        held_out = torch.stack(
            [
                models.mse(example.model(x[:, i : i + 2], h0[:, i : i + 2], c0[:, i : i + 2]),
                           target[i : i + 2])
                for i in range(0, 8, 2)
            ]
        ).mean()  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] == pytest.approx(held_out.item(), rel=1e-5)


def test_the_contract_s_batch_dims_round_trip_and_are_checked(pipeline):
    data = pipeline.to_json()
    assert Pipeline.from_json(data).to_json() == data
    assert [pipeline.batch_dim(n) for n in ("x", "h0", "c0", "target")] == [1, 1, 1, 0]
    assert pipeline.samples_per_microbatch == 2  # along x's dimension 1
    old = {k: v for k, v in data.items() if k != "batch_dims"}  # compiled before them
    assert (
        Pipeline.from_json(old).batch_dims == {}
        and "batch_dims" not in Pipeline.from_json(old).to_json()
    )
    for wrong, message in [
        ({"y": 1}, "pipeline.batch_dims: 'y' is not a pipeline input"),
        ({"x": 3}, "pipeline.batch_dims.x must be a dimension of the input's shape [5, 2, 8]"),
        ({"x": 0}, "pipeline.batch_dims must be an object of dimensions (1 or more)"),
        ([1], "pipeline.batch_dims must be an object"),
    ]:
        with pytest.raises(PipelineFormatError, match=re.escape(message)):
            Pipeline.from_json(data | {"batch_dims": wrong})


def test_batch_dims_are_found_given_and_refused_at_compile_time():
    example = load_example(spec(NAME))
    traced = trace_step(example, CompileOptions(stages=2), loss=LOSS)
    assert dict(traced.model.batch_dims) == FOUND
    overridden = trace_step(example, CompileOptions(stages=2, batch_dims={"x": 0}))
    assert dict(overridden.model.batch_dims) == {"h0": 1, "c0": 1}
    kept = trace_step(load_example(spec("stacked_rnn")), CompileOptions(stages=2, dynamic="t=x:0"))
    assert dict(kept.model.batch_dims) == {"x": 1, "h0": 1}  # an RNN kept whole, time first
    mlp = load_example(spec("mlp"))
    assert not trace_step(mlp, CompileOptions(stages=2)).model.batch_dims  # a stock model
    assert "batch_dims" not in trace_step(mlp, CompileOptions(stages=2)).model.to_json()
    assert dict(
        trace_step(mlp, CompileOptions(stages=2, batch_dims={"x": 1})).model.batch_dims
    ) == {"x": 1}
    for given, message in [
        ({"y": 1}, "--batch-dims y=1: the model has no tensor input 'y' (its tensor inputs: x, "
         "h0, c0)"),
        ({"target": 1}, "a --loss target holds its batch along dimension 0"),
        ({"h0": 3}, "--batch-dims h0=3: input 'h0' has 3 dimension(s) (shape [2, 2, 16] in the "
         "example); give a dimension from 0 to 2"),
    ]:  # fmt: skip
        with pytest.raises(AutopipeError, match=re.escape(message)):
            trace_step(example, CompileOptions(stages=2, batch_dims=given))
    with pytest.raises(AutopipeError, match="--batch-dims must give input dimensions by name"):
        CompileOptions(stages=2, batch_dims={"x": -1})
    assert BatchDims().parse("h0=1, x=1") == {"h0": 1, "x": 1}
    for text in ("h0", "h0=a", "1=1", "h0=1,h0=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            BatchDims().parse(text)


def test_batches_split_and_check_along_the_batch_dims(pipeline):
    """Batches of the package's data function are split along dimension 1, synthetic ones are
    drawn so, torch's schedule is told so, and a batch whose sizes disagree along an input's
    batch dimension is refused naming the input, its dimension and the fix."""
    config = parse_config(["--microbatches", "4", "--data", f"tests/models.py:{BATCHES}"], pipeline)
    batches = Batches(pipeline, config)
    inputs, target = batches(0)
    assert [list(t.shape) for t in inputs] == [[5, 8, 8], [2, 8, 16], [2, 8, 16]]
    assert list(target.shape) == [8]
    synthetic = Batches(pipeline, parse_config(["--microbatches", "4"], pipeline))(0)
    assert [list(t.shape) for t in synthetic[0]] == [[5, 8, 8], [2, 8, 16], [2, 8, 16]]
    assert [spec.split_dim for spec in chunk_spec(pipeline)] == [1, 1, 1]
    two_runs = Batches(
        pipeline,
        parse_config(
            ["--microbatches", "2", "--accumulate", "2", "--data", f"tests/models.py:{BATCHES}"],
            pipeline,
        ),
    )
    (x, h0, c0), target = two_runs.part(two_runs(0), 1)
    assert torch.equal(x, inputs[0][:, 4:]) and torch.equal(h0, inputs[1][:, 4:])
    assert torch.equal(target, models.time_first_lstm_batch(0)[2][4:])

    short = f"tests/models.py:{BATCHES.replace('_batch', '_short_state_batch')}"
    refusing = Batches(pipeline, parse_config(["--microbatches", "4", "--data", short], pipeline))
    with pytest.raises(PipelineRunError) as refused:
        refusing(0)
    assert str(refused.value) == (
        "step 0: input 'h0' has 6 rows (dimension 1), this pipeline takes 8 per step: 4 "
        "microbatches of 2 (--microbatches 4 x --accumulate x --dp x --dp-shard = 4) (its batch "
        "dimension: the package records 1 for 'h0'; compile with --batch-dims to change it). To "
        "take its batches, run with --microbatches 3"
    )


@pytest.mark.slow
def test_the_dry_run_plays_the_time_first_batches(package):
    results, _ = play(load_pipeline(package), "--device", "cpu", "--microbatches", "4")
    assert not problems(results)
