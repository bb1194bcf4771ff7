"""Evaluation during training (issue 27, item 1): ``--eval-data`` batches run forward only
through the pipeline (no gradients, dropout off, nothing recomputed) and their loss, weighted
by label tokens, equals the original model's in eval mode on the same batches, with one stage
per rank and with several; ``--eval-every`` leaves the training exactly as it was; every
evaluation is a JSON line with ``eval_loss``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.evaluation import label_tokens
from autopipe.verify import load_pipeline

from conftest import compile_model, torchrun, torchrun_together
from models import BATCH, gpt2, gpt2_eval_batch

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


def reference_eval_loss() -> float:
    """The original model in eval mode on the held-out batches, microbatch by microbatch, the
    losses weighted by their label tokens (after the causal shift)."""
    model = gpt2()[0].eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for index in range(EVAL_BATCHES):
            (ids,), kwargs = gpt2_eval_batch(index, MICROBATCHES)
            for part, labels in zip(ids.chunk(MICROBATCHES), kwargs["labels"].chunk(MICROBATCHES)):
                count = int((labels[:, 1:] != -100).sum())
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
    result = torchrun(
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
def test_evaluating_every_step_leaves_training_unchanged(tmp_path, weights, two_stages):
    """The same 3 steps with and without an evaluation after each: the same losses and the same
    trained weights, bit for bit; one evaluation per step, the last not repeated at the end;
    ``--eval-only`` on the checkpoint gives the last evaluation again."""
    script = two_stages / "train.py"
    common = ["--load", str(weights), "--steps", "3", "--microbatches", str(MICROBATCHES)]
    common += ["--data", "tests/models.py:gpt2_batch"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    variants = {"plain": [], "evaluated": [*EVAL, "--eval-every", "1", *ckpt]}
    torchrun_together(  # independent: both at once
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

    # --eval-only on the run's checkpoint gives its last evaluation again
    log = tmp_path / "again.jsonl"
    torchrun(script, 2, "--eval-only", *EVAL, *ckpt, "--resume", "--log-json", str(log),
             "--microbatches", str(MICROBATCHES))  # fmt: skip
    (again,) = eval_lines(log)
    assert again["step"] == 2 and again["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
