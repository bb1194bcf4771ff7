"""Evaluation during training (issue 27, item 1): ``--eval-data`` batches run forward only
through the pipeline (no gradients, dropout off, nothing recomputed) and their loss, weighted
by label tokens, equals the original model's in eval mode on the same batches, with one stage
per rank and with several; ``--eval-every`` leaves the training exactly as it was; every
evaluation is a JSON line with ``eval_loss``.

Nothing lost (issue 41): an evaluation restores every random number generator, so that a model
with dropout trains bit for bit as without evaluations; ``--eval-only`` only appends to the
log and the TensorBoard run; a microbatch without label tokens is left out of the mean, held-out
batches without any are refused; what cannot be evaluated is refused, and held-out batches that
read their data more than once say so."""

from __future__ import annotations

import json
import math
import random
import subprocess
from pathlib import Path

import numpy
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.data import Batches
from autopipe.runtime.driver import evaluated_checkpoint_problem
from autopipe.runtime.evaluation import (
    LossSums,
    label_tokens,
    no_label_tokens,
    random_states_kept,
)
from autopipe.runtime.options import parse_config
from autopipe.verify import load_pipeline

from conftest import compile_model, run_ranks, run_ranks_together, start_torchrun
from models import BATCH, gpt2, gpt2_eval_batch, gpt2_eval_batch_partly_unlabelled

MICROBATCHES, EVAL_BATCHES = 4, 2
EVAL = ["--eval-data", "tests/models.py:gpt2_eval_batch", "--eval-batches", str(EVAL_BATCHES)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """The test GPT-2's own weights, for --load: the pipeline then is that model."""
    path = tmp_path_factory.mktemp("eval") / "gpt2.pt"
    torch.save(gpt2()[0].state_dict(), path)
    return path


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> Path:
    """The test GPT-2 in 2 stages, shared by the tests that only run it."""
    out = tmp_path_factory.mktemp("eval") / "pipe"
    compile_model("gpt2", out, 2)
    return out


@pytest.fixture(scope="module")
def dropout_stages(tmp_path_factory) -> Path:
    """The test GPT-2 with dropout 0.1 (the same tensors) in 2 stages."""
    out = tmp_path_factory.mktemp("eval") / "dropout"
    compile_model("gpt2_dropout", out, 2)
    return out


def reference_eval_loss(batch=gpt2_eval_batch) -> float:
    """The original model in eval mode on the held-out batches, microbatch by microbatch, the
    losses weighted by their label tokens (after the causal shift); a microbatch without any
    weighs nothing."""
    model = gpt2()[0].eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for index in range(EVAL_BATCHES):
            (ids,), kwargs = batch(index, MICROBATCHES)
            for part, labels in zip(ids.chunk(MICROBATCHES), kwargs["labels"].chunk(MICROBATCHES)):
                count = int((labels[:, 1:] != -100).sum())
                if count:
                    total += float(model(part, labels=labels).loss) * count
                    tokens += count
    return total / tokens


def eval_lines(log: Path) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if "eval_loss" in e]


def test_label_tokens_count_what_the_loss_averages(two_stages):
    pipeline = Pipeline.from_json(load_pipeline(two_stages).PIPELINE)
    (ids,), kwargs = gpt2_eval_batch(0, MICROBATCHES)
    counts = label_tokens(pipeline, [ids, kwargs["labels"]], MICROBATCHES)
    expected = [int((l[:, 1:] != -100).sum()) for l in kwargs["labels"].chunk(MICROBATCHES)]
    assert counts.tolist() == expected and len(set(expected)) > 1  # they do differ


@pytest.mark.slow
@pytest.mark.parametrize(
    "stages, ranks, schedule",
    [(2, 2, None), (4, 2, "interleaved-1f1b"), (4, 2, "auto")],
    ids=["one-stage-per-rank", "looped", "auto"],  # auto: the greedy orders, run as given
)
def test_eval_only_gives_the_original_models_eval_loss(
    tmp_path, weights, two_stages, stages, ranks, schedule
):
    package = two_stages
    if stages != 2:
        package = tmp_path / "pipe"
        compile_model("gpt2", package, stages, devices=ranks, schedule=schedule)
    log = tmp_path / "log.jsonl"
    result = run_ranks(
        package / "train.py", ranks, "--load", str(weights), "--eval-only", *EVAL,
        "--microbatches", str(MICROBATCHES), "--log-json", str(log),
    )  # fmt: skip
    (entry,) = eval_lines(log)
    expected = reference_eval_loss()
    assert entry["eval_loss"] == pytest.approx(expected, abs=2e-5)
    assert entry["eval_perplexity"] == pytest.approx(math.exp(entry["eval_loss"]))
    assert entry["step"] == -1 and entry["eval_batches"] == EVAL_BATCHES
    assert "eval before training: loss" in result.stdout
    assert not [e for e in map(json.loads, log.read_text().splitlines()) if "loss" in e]


@pytest.mark.slow
def test_evaluating_every_step_leaves_training_unchanged(
    tmp_path, weights, two_stages, dropout_stages
):
    """The same 3 steps of a model with dropout with and without an evaluation after each: the
    same losses and the same trained weights, bit for bit (the evaluations restore every random
    number generator); one evaluation per step, the last not repeated at the end.

    Then, at once: ``--eval-only`` on the checkpoint of step 1 gives that step's evaluation
    again, appended to the run's log and TensorBoard run, whose later steps stay; ``--eval-only
    --load`` onto the plain run's log appends its line, over held-out batches with a microbatch
    without label tokens (left out of the mean); held-out batches without any label token are
    refused, exit non-zero, a run's --save written before its last evaluation."""
    script = dropout_stages / "train.py"
    common = ["--load", str(weights), "--steps", "3", "--microbatches", str(MICROBATCHES)]
    common += ["--data", "tests/models.py:gpt2_batch"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    board = tmp_path / "tb"
    evaluated = [*EVAL, "--eval-every", "1", *ckpt, "--checkpoint-every", "1"]
    variants = {"plain": [], "evaluated": [*evaluated, "--tensorboard", str(board)]}
    run_ranks_together(  # independent: both at once
        *((script, 2, [*common, *extra, "--log-json", str(tmp_path / f"{name}.jsonl"),
                       "--save", str(tmp_path / f"{name}.pt")])
          for name, extra in variants.items())
    )  # fmt: skip
    runs = {
        name: (
            list(map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())),
            torch.load(tmp_path / f"{name}.pt"),
        )
        for name in variants
    }
    plain, evaluated = runs["plain"], runs["evaluated"]
    assert [e["loss"] for e in evaluated[0] if "loss" in e] == [e["loss"] for e in plain[0]]
    assert evaluated[1].keys() == plain[1].keys()
    assert all(torch.equal(evaluated[1][k], plain[1][k]) for k in plain[1])
    evals = [e for e in evaluated[0] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert len({e["eval_loss"] for e in evals}) == 3  # the model changed between them

    logs = {name: (tmp_path / f"{name}.jsonl").read_text().splitlines() for name in variants}
    only = ["--eval-only", "--microbatches", str(MICROBATCHES), "--eval-batches", "2"]
    failing = start_torchrun(  # the last evaluation fails: the trained model is saved before
        two_stages / "train.py", 2, "--load", str(weights), "--steps", "1",
        "--microbatches", str(MICROBATCHES), "--data", "tests/models.py:gpt2_batch",
        "--eval-batches", "2",
        "--eval-data", "tests/models.py:gpt2_eval_batch_unlabelled",
        "--save", str(tmp_path / "failing.pt"), stderr=subprocess.PIPE,
    )  # fmt: skip
    run_ranks_together(
        (script, 2, [*only, "--eval-data", EVAL[1], *ckpt, "--resume-from", "1",
                     "--log-json", str(tmp_path / "evaluated.jsonl"), "--tensorboard", str(board)]),
        (two_stages / "train.py", 2,
         [*only, "--eval-data", "tests/models.py:gpt2_eval_batch_partly_unlabelled",
          "--load", str(weights), "--log-json", str(tmp_path / "plain.jsonl")]),
    )  # fmt: skip
    _, stderr = failing.communicate(timeout=300)
    assert failing.returncode != 0
    assert "train.py: error: evaluation after step 0: the 2 held-out batches of --eval-data " in (
        stderr.decode()
    )
    assert "hold no label tokens: every label is the ignore index -100" in stderr.decode()
    assert torch.load(tmp_path / "failing.pt").keys() == plain[1].keys()
    pipeline = Pipeline.from_json(load_pipeline(two_stages).PIPELINE)  # --eval-only's refusal
    assert no_label_tokens(pipeline, 2, "x.py:f", 0).startswith(
        "evaluation before training: the 2 held-out batches of --eval-data x.py:f hold no label"
    )

    for name, added in (("evaluated", 0), ("plain", -1)):
        now = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert now[: len(logs[name])] == logs[name], name  # the history stays whole
        (entry,) = map(json.loads, now[len(logs[name]) :])
        assert entry["step"] == added, name
        if name == "evaluated":  # step 1's checkpoint: step 0's evaluation again, bit for bit
            assert entry["eval_loss"] == evals[0]["eval_loss"]
        else:
            expected = reference_eval_loss(gpt2_eval_batch_partly_unlabelled)
            assert entry["eval_loss"] == pytest.approx(expected, abs=2e-5)
            assert entry["eval_microbatches_without_labels"] == 2  # one per held-out batch
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]  # nothing purged
    assert sorted(e.step for e in events.Scalars("eval/loss")) == [0, 0, 1, 2]


# -- in process ------------------------------------------------------------------------------
def test_a_microbatch_without_label_tokens_weighs_nothing():
    """Its loss is 0 / 0 = NaN, and NaN x 0 is NaN: it is left out, not multiplied."""
    sums = LossSums()
    losses = [torch.tensor(2.0), torch.tensor(math.nan), torch.tensor(5.0)]
    sums.add(losses, torch.tensor([3.0, 0.0, 1.0], dtype=torch.float64))
    assert sums.mean == pytest.approx((2.0 * 3 + 5.0) / 4) and sums.empty == 1
    nothing = LossSums()
    nothing.add(losses[1:2], torch.zeros(1, dtype=torch.float64))
    assert nothing.weight == 0 and math.isnan(nothing.mean)


def test_an_evaluation_restores_every_random_generator():
    """torch's, Python's and numpy's generators continue after an evaluation as if there had
    been none; inside, torch draws the same numbers at every evaluation."""
    cpu = torch.device("cpu")
    torch.manual_seed(7)
    random.seed(7)
    numpy.random.seed(7)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    draws = []
    torch.manual_seed(7)
    random.seed(7)
    numpy.random.seed(7)
    for _ in range(2):
        with random_states_kept(cpu, seed=11):
            draws.append(torch.rand(3))
            random.random(), numpy.random.rand()  # the user's eval function may draw these
    assert torch.equal(draws[0], draws[1])
    got = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    state = torch.get_rng_state()
    with pytest.raises(KeyError), random_states_kept(cpu, seed=11):
        torch.rand(5)
        raise KeyError("a failing evaluation restores them too")
    assert torch.equal(torch.get_rng_state(), state)


def test_what_cannot_be_evaluated_is_refused_before_it_runs(two_stages, tmp_path, capsys):
    """--eval-only given a --checkpoint-dir that does not exist, or holds no checkpoint, would
    evaluate the initial weights; --eval-only --save would write untrained weights silently."""
    pipeline = Pipeline.from_json(load_pipeline(two_stages).PIPELINE)
    only = ["--eval-only", "--eval-data", EVAL[1]]
    (tmp_path / "empty").mkdir()
    for directory, said in (("misspelt", "there is no such directory"), ("empty", "no checkpoint")):
        config = parse_config([*only, "--checkpoint-dir", str(tmp_path / directory)], pipeline)
        problem = evaluated_checkpoint_problem(config)
        assert problem.startswith(f"--eval-only --checkpoint-dir {tmp_path / directory}: {said}")
    assert evaluated_checkpoint_problem(parse_config(only, pipeline)) is None
    with pytest.raises(SystemExit):
        parse_config([*only, "--save", "out.pt"], pipeline)
    assert "--eval-only trains nothing, so --save out.pt would hold" in capsys.readouterr().err


def test_held_out_batches_that_read_their_data_again_say_so(two_stages):
    pipeline = Pipeline.from_json(load_pipeline(two_stages).PIPELINE)
    argv = ["--microbatches", "4", "--eval-data", "tests/models.py:gpt2_tiny_dataset"]
    batches = Batches(pipeline, parse_config(argv, pipeline), held_out=True)
    assert batches.coverage(2) == (
        "--eval-data tests/models.py:gpt2_tiny_dataset: its dataset holds 3 samples, and 2 "
        "held-out batches of 8 samples read 16: the held-out loss counts each sample about "
        "5.33 times; give a held-out dataset of at least 8 samples (a batch's)"
    )
    argv[-1] = "tests/models.py:gpt2_dataset"  # 40 samples: 5 batches of 8
    batches = Batches(pipeline, parse_config(argv, pipeline), held_out=True)
    assert batches.coverage(5) is None
    assert "give --eval-batches 5 to read each sample once" in batches.coverage(6)
    # training data smaller than a step's batch is refused (each step would read some twice)
    train = ["--microbatches", "4", "--data", "tests/models.py:gpt2_tiny_dataset"]
    with pytest.raises(PipelineRunError) as small:
        Batches(pipeline, parse_config(train, pipeline))
    assert str(small.value) == (
        "--data tests/models.py:gpt2_tiny_dataset: its dataset holds 3 samples, fewer than a "
        "step's batch of 8 (--microbatches x --accumulate x --dp x --dp-shard x the example's "
        "samples): each step would read some twice; give more samples, or fewer --microbatches"
    )
