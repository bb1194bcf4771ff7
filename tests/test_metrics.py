"""train.py's metrics (runtime/metrics.py): MFU is against the device that runs. The plan's peak
FLOP/s are those of the device spec it was made for; a run on another device (a CPU run of an
H100 plan) shows no MFU and says once why, and the plan's own line keeps naming the device its
predicted MFU is for. The JSON log is strict JSON (non-finite numbers are null, and named), and
an evaluation alone appends to it without truncating."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autopipe.runtime.core.pipeline import Loss, Pipeline, Value
from autopipe.runtime.driver import plan_note
from autopipe.runtime.evaluation import EvalResult
from autopipe.runtime.metrics import Metrics, json_line, plan_device_problem
from autopipe.runtime.options import parse_config

from conftest import ROOT

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "plan, gpu, shown",
    [
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("H100-PCIe", "NVIDIA H100 PCIe", True),
        ("A100-40GB", "NVIDIA A100-SXM4-40GB", True),
        ("RTX4090", "NVIDIA GeForce RTX 4090", True),
        ("NVIDIA H200", "NVIDIA H200", True),  # a spec autopipe calibrate named after the GPU
        ("H100", "NVIDIA H200", False),
        ("L4", "NVIDIA L40S", False),
        ("A100-40GB", "NVIDIA A100-SXM4-80GB", False),
        ("cpu-2-cores", "NVIDIA H100 80GB HBM3", False),
    ],
)
def test_mfu_on_cuda_only_against_the_gpu_that_runs(monkeypatch, plan, gpu, shown):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    problem = plan_device_problem(plan, CUDA)
    assert (problem is None) == shown
    if not shown:
        assert problem.startswith(f"the plan was made for {plan}, this run is on {gpu}: ")
        assert "MFU is not shown" in problem and "--device-spec cuda" in problem


def test_mfu_on_the_cpu_only_against_a_calibrated_cpu():
    assert plan_device_problem("cpu-2-cores", CPU) is None  # as autopipe calibrate names one
    assert plan_device_problem("cpu (AMD EPYC, 1 thread)", CPU) is None  # --device-spec cpu's
    problem = plan_device_problem("H100", CPU)
    assert problem.startswith("the plan was made for H100, this run is on the cpu: ")
    assert "not compared with the plan's" in problem and "--device-spec cpu" in problem


def test_a_step_without_mfu_says_none(tmp_path, capsys):
    """The step line and the JSON log carry MFU only where the run has one."""
    for utilisation, shown in ((lambda seconds: 0.25, True), (lambda seconds: None, False)):
        path = tmp_path / f"{shown}.jsonl"
        log = Metrics(
            reporting=True, steps=1, samples_per_step=4, tokens_per_step=None,
            log_json=str(path), log_every=1, resumed_at=None, utilisation=utilisation,
        )  # fmt: skip
        log.record(0, 1.0, 0.5, 1e-3, 1.0, [1 << 20], [1 << 20])
        log.close()
        assert ("MFU 25%" in capsys.readouterr().out) == shown
        assert ("mfu" in json.loads(path.read_text())) == shown


def test_log_lines_are_strict_json_and_an_evaluation_alone_only_appends(tmp_path, capsys):
    """Issue 41: a number that is not finite is null in the log, with the field named in
    ``not_finite`` (a skipped step's NaN loss, a huge loss's infinite perplexity); a metrics
    log opened for an evaluation alone (``--eval-only``) keeps every line, even those after the
    step it evaluates, where a resumed training truncates them and a fresh one replaces them."""
    path = tmp_path / "log.jsonl"
    train = Metrics(True, 3, 4, None, str(path), 1, None)
    for step in range(3):
        train.record(step, math.nan if step == 1 else 1.0, 0.5, 1e-3, 1.0, [1], [1], step == 1)
    train.close()
    lines = path.read_text().splitlines()
    skipped = json.loads(lines[1])
    assert skipped["loss"] is None and skipped["not_finite"] == {"loss": "nan"}
    assert "not_finite" not in json.loads(lines[0])

    evaluation = Metrics(True, 3, 4, None, str(path), 1, None, appends=True)
    evaluation.record_eval(1, EvalResult(800.0, 2, 0.1, empty=3))
    evaluation.close()
    after = path.read_text().splitlines()
    assert after[:3] == lines  # nothing of the training's history lost
    (entry,) = [json.loads(line, parse_constant=pytest.fail) for line in after[3:]]
    assert entry["eval_perplexity"] is None and entry["not_finite"] == {"eval_perplexity": "inf"}
    assert entry["eval_loss"] == 800.0 and entry["eval_microbatches_without_labels"] == 3
    assert "3 microbatches without label tokens left out" in capsys.readouterr().out

    resumed = Metrics(True, 3, 4, None, str(path), 1, resumed_at=1)  # training again from 1
    resumed.close()
    assert path.read_text().splitlines() == [lines[0], after[3]]  # the lines of step 0

    elsewhere = tmp_path / "logs" / "of" / "run.jsonl"  # folders checked writable, then made
    Metrics(True, 3, 4, None, str(elsewhere), 1, None).close()
    assert elsewhere.is_file()
    mine = tmp_path / "notes.txt"  # no run's log, replaced under --force: written anew
    for resumed_at, appends in ((1, False), (None, True)):
        mine.write_bytes(b"\xff not text, not a log\n")
        Metrics(True, 3, 4, None, str(mine), 1, resumed_at, appends=appends).close()
        assert mine.read_bytes() == b""


def test_perplexity_is_said_of_a_loss_over_tokens_only(tmp_path, capsys):
    """An evaluation's console line gives the perplexity of a language model's loss (labels of
    shape (batch, sequence)), not of a classifier's or a regression's; the log keeps the field
    (issue 27's keys) either way."""
    lm = Pipeline.from_json(json.loads((ROOT / "generated/gpt2_4/pipeline.json").read_text()))
    assert lm.loss_over_tokens  # Hugging Face's labels input, (batch, sequence) integers
    per_sample = Value("target", (4,), "int64", False)
    for target, over_tokens in (
        (per_sample, False),  # a classifier's class per sample
        (dataclasses.replace(per_sample, shape=(4, 128)), True),  # a loss module's token labels
        (dataclasses.replace(per_sample, shape=(4, 128), dtype="float32"), False),  # regression
    ):
        model = dataclasses.replace(lm, loss=Loss(module="loss", target=target))
        assert model.loss_over_tokens == over_tokens
    for perplexity in (True, False):
        path = tmp_path / f"{perplexity}.jsonl"
        metrics = Metrics(True, 1, 4, None, str(path), 1, None, perplexity=perplexity)
        metrics.record_eval(1, EvalResult(0.5, 2, 0.1))
        metrics.close()
        assert ("perplexity 1.649" in capsys.readouterr().out) == perplexity
        assert json.loads(path.read_text())["eval_perplexity"] == pytest.approx(math.exp(0.5))


def test_json_lines_name_nested_values_that_are_not_finite():
    line = json_line({"step": 2, "rank_times": [{"rank": 0, "vs_plan": math.inf}]})
    assert json.loads(line) == {
        "step": 2,
        "rank_times": [{"rank": 0, "vs_plan": None}],
        "not_finite": {"rank_times[0].vs_plan": "inf"},
    }


def test_the_plan_line_names_what_the_run_changed():
    """The plan's line at a run's start names the options in which the run differs from the
    plan (another microbatch count is no other layout), nothing where it runs the plan."""
    gpt2 = Pipeline.from_json(json.loads((ROOT / "generated/gpt2_4/pipeline.json").read_text()))
    assert gpt2.plan is not None and gpt2.plan.microbatches != 16
    assert "(this run" not in plan_note(gpt2, parse_config([], gpt2), 4)
    changed = parse_config(["--microbatches", "16", "--dp", "2"], gpt2)
    assert plan_note(gpt2, changed, 8).endswith(
        "(this run: --microbatches 16, --dp 2 on 8 processes)"
    )
