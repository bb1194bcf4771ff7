"""Every error reaches the user once, with the numbers (issue 26): another model's checkpoint
directory is refused before anything is written, a failure only rank 1 finds is printed by rank 1
(rank 0 says it stopped because of it, not that it "lost contact"), an exception in user code is
named with its step and line (its traceback in a log file), a batch unlike the pipeline's names
the step, the input and the fix for what differs, a stopped save leaves no ``.partial``, and an
edited package is said to be edited."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from autopipe.runtime import driver, failures, train_state
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.data import Batches
from autopipe.runtime.options import parse_config
from autopipe.verify import load_pipeline

from conftest import ONE_PROCESS, compile_model, torchrun_command, torchrun_env, training_state

GPT2_DATA = ["--microbatches", "4", "--data", "tests/models.py:gpt2_batch"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """2-stage packages: the 3-layer test GPT-2, a 2-layer one, and a CNN whose loss takes a
    target (so rank 1 reads data too)."""
    root = tmp_path_factory.mktemp("failures")
    compile_model("gpt2", root / "three", 2)
    compile_model("gpt2_two_layers", root / "two", 2)
    compile_model("cnn_with_target", root / "cnn", 2, loss="tests/models.py:cross_entropy")
    return {name: root / name for name in ("three", "two", "cnn")}


def run(package: Path, *args: str) -> subprocess.CompletedProcess:
    """train.py on 2 gloo ranks, without raising on failure."""
    return subprocess.run(
        torchrun_command(package / "train.py", 2, *args),
        capture_output=True,
        text=True,
        timeout=300,
        env=torchrun_env(),
        cwd=Path(__file__).resolve().parent.parent,
    )


def train_py_lines(result: subprocess.CompletedProcess, package: Path) -> list[str]:
    """train.py's own lines of stderr; asserts that no traceback of the package came with them
    (torchrun adds its own summary of the failed child, which is not train.py's)."""
    assert f'File "{package}' not in result.stderr, result.stderr[-4000:]
    return [line for line in result.stderr.splitlines() if line.startswith("train.py:")]


def checksums(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_another_models_checkpoints_are_neither_resumed_nor_pruned(packages, tmp_path):
    """Defect 1: the 2-layer model started with --resume on the 3-layer model's checkpoints
    exits 2 before the first step, names the first tensor that differs, and leaves every file
    of the other run as it was (pruning with --keep-checkpoints 1 included)."""
    ckpt = tmp_path / "ck"
    first = run(
        packages["three"], *GPT2_DATA, "--steps", "2", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "1",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    before = checksums(ckpt)
    second = run(
        packages["two"], *GPT2_DATA, "--steps", "4", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "1", "--keep-checkpoints", "1", "--resume",
    )  # fmt: skip
    assert second.returncode != 0
    errors = [line for line in train_py_lines(second, packages["two"]) if "error" in line]
    assert len(errors) == 1, second.stderr[-3000:]  # said once
    assert "holds checkpoints of another model than GPT2LMHeadModel" in errors[0]
    assert "transformer.h.2." in errors[0] and "own --checkpoint-dir" in errors[0]
    assert "resumed" not in second.stdout
    assert checksums(ckpt) == before


@pytest.mark.slow
def test_a_failure_only_rank_1_finds_is_printed_and_named_by_the_others(packages):
    """Defects 2 and 3: the --data function fails on rank 1 alone (it reads the targets). Rank 1
    prints the error with its step, its line and its rank and stage, and where the traceback
    went; rank 0 says it stopped because rank 1 failed, not that it lost contact."""
    result = run(
        packages["cnn"], "--microbatches", "4", "--steps", "2",
        "--data", "tests/models.py:cnn_batch_failing_on_rank_1",
    )  # fmt: skip
    assert result.returncode != 0
    lines = train_py_lines(result, packages["cnn"])
    errors = [line for line in lines if line.startswith("train.py: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    expected = (
        "train.py: error: --data tests/models.py:cnn_batch_failing_on_rank_1 raised at step 0: "
        "ValueError: no target shard for step 0 on this node (tests/models.py:"
    )
    assert errors[0].startswith(expected), errors[0]
    assert errors[0].endswith("(rank 1, stage 1)")
    assert "lost contact" not in result.stderr
    assert any("rank 0 stopped because rank 1 failed" in line for line in lines), lines
    logs = [line for line in lines if "the full traceback" in line]
    assert len(logs) == 1
    log = Path(logs[0].rsplit(" is in ", 1)[1])
    assert "Traceback" in log.read_text() and "no target shard" in log.read_text()
    log.unlink()


@pytest.mark.slow
def test_a_data_function_raising_at_a_later_step_is_named(packages):
    """Defect 3: an exception in --data at step 1 (rank 0) stops every rank with one line
    naming the function, the step, the exception and the user's line."""
    result = run(
        packages["three"], "--microbatches", "4", "--steps", "3",
        "--data", "tests/models.py:gpt2_batch_failing_at_step_1",
    )  # fmt: skip
    assert result.returncode != 0
    errors = [
        line
        for line in train_py_lines(result, packages["three"])
        if line.startswith("train.py: error:")
    ]
    assert len(errors) == 1, result.stderr[-3000:]
    source = Path("tests/models.py").read_text().splitlines()
    raising = next(i for i, text in enumerate(source, 1) if 'shards["validation"]' in text)
    assert errors[0].startswith(
        "train.py: error: --data tests/models.py:gpt2_batch_failing_at_step_1 raised at step 1: "
        f"KeyError: 'validation' (tests/models.py:{raising})"
    ), errors[0]
    assert "lost contact" not in result.stderr


def _batches(package: Path, *argv: str) -> Batches:
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    return Batches(pipeline, parse_config(["--microbatches", "4", *argv], pipeline))


def test_batch_mismatches_name_the_step_the_input_and_the_fix(packages):
    batches = _batches(packages["three"])
    ids = torch.zeros(8, 16, dtype=torch.long)

    def call(batch: dict[str, torch.Tensor], step: int, _target: None) -> None:
        batches.fn = lambda _step: ((), batch)  # a --data function returning this batch
        batches(step)

    with pytest.raises(PipelineRunError) as dtype:
        call({"input_ids": ids.float(), "labels": ids}, 5, None)
    assert str(dtype.value).startswith("step 5: input 'input_ids' is float32")
    assert "convert it in the --data function" in str(dtype.value)
    assert "--microbatches" not in str(dtype.value)

    with pytest.raises(PipelineRunError) as length:
        call({"input_ids": ids[:, :12], "labels": ids[:, :12]}, 6, None)
    assert str(length.value).startswith("step 6: input 'input_ids' has shape [8, 12]")
    assert "dimension 1 is 12 where the pipeline was compiled for 16" in str(length.value)
    assert "--dynamic" in str(length.value) and "pad" in str(length.value)
    assert "--microbatches" not in str(length.value)

    with pytest.raises(PipelineRunError) as rows:
        call({"input_ids": ids[:4], "labels": ids[:4]}, 7, None)
    assert str(rows.value).startswith("step 7: input 'input_ids' has 4 rows")
    assert "run with --microbatches 2" in str(rows.value)


def test_a_stopped_save_leaves_no_partial(tmp_path, packages, single_process_group, monkeypatch):
    """A stop (SIGTERM becomes KeyboardInterrupt) while a checkpoint is written removes its
    ``.step-N.partial`` on the way out; the previous checkpoint stays the latest."""
    package = load_pipeline(packages["three"])
    stages, optimizers = training_state(package, 2)
    checkpoints = train_state.TrainingCheckpoints(tmp_path / "ck", package.PIPELINE, ONE_PROCESS, 0)
    checkpoints.save(1, stages, optimizers)

    def stopped(*_args):
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(checkpoints, "_write_own", stopped)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2, stages, optimizers)
    assert not list((tmp_path / "ck").glob(".*partial"))
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000001"


def test_an_edited_package_is_said_to_be_edited(tmp_path, capsys):
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    driver.warn_if_edited(package)
    assert capsys.readouterr().err == ""
    stage = tmp_path / "pipe" / "stage1.py"
    stage.write_text(stage.read_text() + "\n# tuned by hand\n")
    driver.warn_if_edited(package)
    warning = capsys.readouterr().err
    assert warning.startswith("train.py: warning: stage1.py differs from what autopipe generated")
    assert "autopipe verify" in warning


def test_error_logs_are_new_private_files(tmp_path, monkeypatch):
    """A traceback's log is created anew (never through a name planted beforehand: a link in
    the temporary directory is neither followed nor written) in a directory only its user can
    enter, readable by its owner only, under a name no one can guess."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = failures.write_error_log("one", 0), failures.write_error_log("two", 0)
    assert first is not None and second is not None and first != second
    assert first.parent == tmp_path / f"autopipe-{os.getuid()}"
    assert first.read_text() == "one" and second.read_text() == "two"
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert first.name.startswith("train-error-rank0-") and first.suffix == ".log"
    # another's directory under that name (here: a link to a place anyone can write)
    shutil.rmtree(first.parent)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o777)
    first.parent.symlink_to(victim, target_is_directory=True)
    planted = failures.write_error_log("three", 1)
    assert planted is not None and planted.read_text() == "three"
    assert not any(victim.iterdir()) and planted.parent.parent == tmp_path
    assert stat.S_IMODE(planted.parent.stat().st_mode) == 0o700
