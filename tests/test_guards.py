"""A training run never loses good work and never hides a bad step (issue 11): non-finite steps
stop the run (or are skipped) before they reach weights or checkpoints, outputs are checked before
the first step, one run owns a checkpoint directory, a failed checkpoint write keeps the previous
one, damaged checkpoints are named with the intact one to use instead."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
import subprocess
import time
from pathlib import Path

import pytest
import torch

from autopipe.cli import main as autopipe_main
from autopipe.runtime import driver, options, train_state
from autopipe.runtime.checkpoint import Checkpoint, CheckpointError, save_safetensors
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.guards import RunLock, output_problems
from autopipe.runtime.options import parse_config
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example

from autopipe.verify import load_pipeline

from conftest import (
    ONE_PROCESS,
    ROOT,
    compile_model,
    spec,
    start_torchrun,
    torchrun_command,
    torchrun_env,
    training_state,
)

STEPS = ["--microbatches", "4", "--data", "tests/models.py:gpt2_batch"]


@pytest.fixture(scope="module")
def gpt2_pipe(tmp_path_factory) -> Path:
    """One 2-stage GPT-2 package shared by the tests of this file (they only run it)."""
    out = tmp_path_factory.mktemp("guards") / "pipe"
    compile_model("gpt2", out, 2)
    return out


def run(package: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """train.py on 2 gloo ranks, without raising on failure."""
    return subprocess.run(
        torchrun_command(package / "train.py", 2, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=torchrun_env(),
        cwd=ROOT,
    )


def error_of(result: subprocess.CompletedProcess, package: Path) -> str:
    """train.py's one error line; asserts the run failed without a traceback from the package
    (torchrun adds its own summary of the failed child, which is not train.py's)."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert f'File "{package}' not in result.stderr, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1, result.stderr[-4000:]  # said once, by one rank
    return lines[0]


def test_a_bad_option_is_said_once_by_the_first_rank(gpt2_pipe, monkeypatch, capsys):
    """Every rank reads the same command line: the first rank says what is wrong with it at
    once; the others wait for torchrun to end them once rank 0 has exited (so that rank 0 is
    never ended before it says it), and say it themselves if it does not."""
    pipeline = Pipeline.from_json(load_pipeline(gpt2_pipe).PIPELINE)
    monkeypatch.setenv("WORLD_SIZE", "2")

    class Ended(BaseException):
        """torchrun's SIGTERM, once rank 0 has exited"""

    def ended(seconds):
        assert seconds == options.OTHER_RANKS_WAIT
        raise Ended

    said_by = {}
    for rank, wait in (("1", ended), ("0", ended), ("1", lambda seconds: None)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(options.time, "sleep", wait)
        with pytest.raises((SystemExit, Ended)) as stopped:
            parse_config(["--stepz", "3"], pipeline)
        said = "train.py: error: unrecognized arguments: --stepz 3" in capsys.readouterr().err
        said_by[rank, wait is ended] = (said, getattr(stopped.value, "code", None))
    assert said_by == {
        ("1", True): (False, None),  # ended while it waits: quiet
        ("0", True): (True, 2),  # says it at once
        ("1", False): (True, 2),  # not ended: rank 0 did not find it, so this rank says it
    }


def test_a_failed_run_points_to_a_checkpoint_only_where_one_is(tmp_path):
    """A failed run's message says to resume from --checkpoint-dir's latest checkpoint once
    one is complete there (read when the run fails), and says nothing of one before."""
    hint = driver.ResumeHint(str(tmp_path / "ckpt"))
    assert str(hint) == "" and str(driver.ResumeHint(None)) == ""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step-00000002\n")
    assert f"rerun with --resume to continue from {tmp_path / 'ckpt'}/latest" in str(hint)


def losses(log: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]


@pytest.mark.slow
def test_diverging_run_stops_and_keeps_the_good_checkpoints(gpt2_pipe, tmp_path):
    """--lr 1e6 makes step 1 NaN: the run stops there, exit non-zero, naming the step; the
    checkpoint of step 1 (good weights) stays latest and is never pruned by --keep-checkpoints 1."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    result = run(
        gpt2_pipe, *STEPS, "--steps", "6", "--lr", "1e6", "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "1", "--keep-checkpoints", "1", "--log-json", str(log),
        "--save", str(tmp_path / "final.pt"),
    )  # fmt: skip
    message = error_of(result, gpt2_pipe)
    assert "step 1: the loss" in message and "not finite" in message and "--lr" in message
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("step-")] == ["step-00000001"]
    state, manifest = train_state.merge_checkpoint(ckpt)
    assert manifest["step"] == 1 and all(torch.isfinite(t).all() for t in state.values())
    assert [step for step, _ in losses(log)] == [0]  # the bad step is not logged as trained
    assert not (tmp_path / "final.pt").exists() and not (ckpt / ".lock").exists()


@pytest.mark.slow
def test_all_labels_ignored_is_named_and_can_be_skipped(gpt2_pipe, tmp_path):
    """A batch whose labels are all -100 has a NaN loss: stopped by default with a hint; with
    --skip-nonfinite the step is skipped (weights untouched) and the run goes on."""
    data = ["--microbatches", "4", "--data", "tests/models.py:gpt2_batch_with_ignored_labels"]
    message = error_of(run(gpt2_pipe, *data, "--steps", "3"), gpt2_pipe)
    assert "step 1: the loss" in message and "ignore index (-100)" in message

    log = tmp_path / "log.jsonl"
    ok = run(gpt2_pipe, *data, "--steps", "3", "--skip-nonfinite", "--log-json", str(log))
    assert ok.returncode == 0, ok.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    assert records[1]["loss"] is None and records[1]["not_finite"] == {"loss": "nan"}
    assert all(math.isfinite(r["loss"]) for r in records[::2])


@pytest.mark.slow
def test_output_paths_are_checked_before_the_first_step(gpt2_pipe, tmp_path):
    """Every rank checks the paths it will write (guards.output_problems) before any training;
    train.py stops on a problem, said once by rank 0, with nothing trained or written."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("mine")
    cases = {
        ("--save", str(tmp_path / "a_dir")): "is a directory",
        ("--save", f"{tmp_path}/new_dir/"): "is a directory",  # not written as a file new_dir
        ("--log-json", f"{tmp_path}/logs/"): "is a directory",
        ("--save", str(tmp_path / "a_file" / "model.pt")): "is a file, not a directory",
        ("--checkpoint-dir", str(tmp_path / "a_file")): "is a file, not a directory",
        ("--log-json", "/proc/autopipe/log.jsonl"): "cannot write in /proc",
        # a file of the user's, which the run would replace: only with --force
        ("--save", str(tmp_path / "a_file")): "exists: the run would replace it; pass --force",
        ("--log-json", str(tmp_path / "a_file")): "is not a log of a run's steps",
    }
    for (option, value), problem in cases.items():
        paths = dict.fromkeys(("save", "log_json", "checkpoint_dir"))
        paths[option.removeprefix("--").replace("-", "_")] = value
        (found,) = output_problems(**paths)
        assert option in found and problem in found
    (tmp_path / "log.jsonl").write_text('{"step": 0, "loss": 1.0}\n')  # a run's log: replaced
    (tmp_path / "config.json").write_text('{"lr": 0.1}\n')  # JSON, no log of steps
    (found,) = output_problems(
        save=None, log_json=str(tmp_path / "config.json"), checkpoint_dir=None
    )
    assert "is not a log of a run's steps" in found
    # a run resuming from its checkpoint replaces the --save file it wrote when it ended before
    assert output_problems(save=str(tmp_path / "a_file"), log_json=None, checkpoint_dir=None,
                           resuming=True) == []  # fmt: skip
    replaced = {"save": str(tmp_path / "a_file"), "log_json": str(tmp_path / "a_file")}
    assert output_problems(**replaced, checkpoint_dir=None, replace=True) == []
    assert (
        output_problems(save=None, log_json=str(tmp_path / "log.jsonl"), checkpoint_dir=None) == []
    )
    (option, value), problem = next(iter(cases.items()))  # as train.py says it
    message = error_of(run(gpt2_pipe, *STEPS, "--steps", "2", option, value), gpt2_pipe)
    assert option in message and problem in message and "Nothing was trained" in message
    assert "step 0" not in message
    assert (tmp_path / "a_file").read_text() == "mine" and not any((tmp_path / "a_dir").iterdir())


def test_save_stays_apart_from_the_checkpoints_and_the_package(tmp_path, capsys):
    """--save that is, lies inside or holds --checkpoint-dir or the package (links resolved)
    is refused when the options are read, before anything runs: the trained model and the
    run's checkpoints or the package's files would be written over each other."""
    gallery = json.loads((ROOT / "generated" / "gpt2_4" / "pipeline.json").read_text())
    pipeline = Pipeline.from_json(gallery)
    package, out = tmp_path / "pipe", tmp_path / "out"
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    cases = [
        (["--save", str(out), "--checkpoint-dir", str(tmp_path / "link")], "is --checkpoint-dir"),
        (["--save", str(out), "--save-format", "hf", "--checkpoint-dir", str(out / "ckpt")],
         "holds --checkpoint-dir"),
        (["--save", str(out / "ckpt" / "model.pt"), "--checkpoint-dir", str(out / "ckpt")],
         "is inside --checkpoint-dir"),
        (["--save", str(package / "model.pt")], f"is inside this package ({package})"),
        (["--save", str(tmp_path), "--save-format", "hf"], f"holds this package ({package})"),
    ]  # fmt: skip
    for argv, relation in cases:
        with pytest.raises(SystemExit):
            parse_config(argv, pipeline, package)
        assert relation in capsys.readouterr().err, argv
    apart = ["--save", str(out / "model"), "--checkpoint-dir", str(out / "checkpoints")]
    assert parse_config(apart, pipeline, package).save == str(out / "model")
    # checkpoints asked for without a folder to write them into would be silently none
    with pytest.raises(SystemExit):
        parse_config(["--checkpoint-every", "2"], pipeline, package)
    assert "--checkpoint-every 2 writes checkpoints into --checkpoint-dir DIR; give it" in (
        capsys.readouterr().err
    )
    # and held-out batches counted without the data to read them from
    with pytest.raises(SystemExit):
        parse_config(["--eval-batches", "3"], pipeline, package)
    assert "--eval-batches 3 counts the held-out batches of --eval-data FILE.py:FN; give" in (
        capsys.readouterr().err
    )
    assert parse_config([], pipeline, package).eval_batches == 1


def test_a_failed_final_save_is_written_elsewhere(tmp_path, monkeypatch):
    """If --save cannot be written at the end after all, the state goes to the checkpoint dir and
    the error says where; if nothing takes it, the error names the last checkpoint."""
    state = {"w": torch.arange(4.0)}
    real = driver.save_weights
    refused = str(tmp_path / "gone" / "model.pt")

    def save(state, path, file_format=None):
        if str(path) == refused:
            raise OSError(28, "No space left on device")
        real(state, path)

    monkeypatch.setattr(driver, "save_weights", save)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the last fallback's place
    gallery = json.loads((ROOT / "generated" / "gpt2_4" / "pipeline.json").read_text())
    pipeline = Pipeline.from_json(gallery)
    args = parse_config(["--save", refused, "--checkpoint-dir", str(tmp_path / "ckpt")], pipeline)
    with pytest.raises(PipelineRunError) as caught:
        driver.save_trained(state, pipeline, args, 7, None)
    fallback = tmp_path / "ckpt" / "trained-step-7.pt"
    assert f"could not write --save {refused}" in str(caught.value)
    assert f"written to {fallback} instead" in str(caught.value)
    assert torch.equal(torch.load(fallback)["w"], state["w"])

    monkeypatch.setattr(driver, "save_weights", lambda *_: (_ for _ in ()).throw(OSError("bad")))
    with pytest.raises(PipelineRunError, match="anywhere .* the last checkpoint is ck/step-1"):
        driver.save_trained(state, pipeline, args, 7, Path("ck/step-1"))


def test_trained_weights_are_never_written_through_a_planted_link(tmp_path, monkeypatch):
    """The last fallback of a final save is a new file of a unique name in the user's private
    directory of $TMPDIR, and every save writes a temporary created exclusively beside its
    destination: links planted at the names used before (``$TMPDIR/trained-step-N.pt``,
    ``.NAME.tmpPID``) are neither followed nor overwritten, the error names the file written,
    which is complete; a failed rename removes its temporary and says so."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours")
    (tmp_path / "trained-step-7.pt").symlink_to(victim)
    state = {"w": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64)}
    refused = {str(tmp_path / "gone" / "model.pt"), str(tmp_path / "work" / "trained-step-7.pt")}
    real = driver.save_weights

    def save(state, path, file_format=None):
        if str(path) in refused:  # --save and the working directory take nothing
            raise OSError(28, "No space left on device")
        real(state, path, file_format)

    monkeypatch.setattr(driver, "save_weights", save)
    gallery = json.loads((ROOT / "generated" / "gpt2_4" / "pipeline.json").read_text())
    pipeline = Pipeline.from_json(gallery)
    args = parse_config(["--save", str(tmp_path / "gone" / "model.pt")], pipeline)
    with pytest.raises(PipelineRunError) as caught:
        driver.save_trained(state, pipeline, args, 7, None)
    private = tmp_path / f"autopipe-{os.getuid()}"
    (written,) = private.glob("trained-step-7-*.pt")
    assert f"written to {written} instead" in str(caught.value)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    loaded = torch.load(written, weights_only=True)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert victim.read_bytes() == b"not yours" and (tmp_path / "trained-step-7.pt").is_symlink()

    # the temporary's old name beside the destination, planted as a link
    target = tmp_path / "model.safetensors"
    (tmp_path / f".{target.name}.tmp{os.getpid()}").symlink_to(victim)
    train_state.save_weights(state, target)
    assert victim.read_bytes() == b"not yours"
    assert torch.equal(Checkpoint(target)["w"], state["w"])
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()
    assert not list(tmp_path.glob(f".{target.name}.*.tmp"))

    def refuse(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="could not rename .*; it was removed, and .* is as it was"):
        train_state.save_weights({"w": torch.zeros(2)}, target)
    monkeypatch.undo()
    assert not list(tmp_path.glob(f".{target.name}.*.tmp"))
    assert torch.equal(Checkpoint(target)["w"], state["w"])


def _umask() -> int:
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


@pytest.mark.slow
def test_a_checkpoint_dir_belongs_to_one_run(gpt2_pipe, tmp_path):
    """A second run on a live run's --checkpoint-dir is refused, naming the owner; the first
    finishes intact; a lock left by a dead process is taken over (by a resume with no step
    left to train, which says so)."""
    ckpt, gate = tmp_path / "ckpt", tmp_path / "go-on"
    held = ["--microbatches", "4", "--data", "tests/models.py:gpt2_batch_held_at_step_2"]
    with open(tmp_path / "first.err", "w") as errors:
        first = start_torchrun(
            gpt2_pipe / "train.py", 2, *held, "--steps", "8", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2", stderr=errors, env={"HOLD_UNTIL": str(gate)},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (ckpt / ".lock").exists():
                assert first.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            owner = json.loads((ckpt / ".lock").read_text())
            second = run(
                gpt2_pipe, *STEPS, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume"
            )
            assert first.poll() is None  # the first run holds at step 2 until the gate opens
        finally:
            gate.touch()
        message = error_of(second, gpt2_pipe)
        assert "in use by another training run" in message and f"pid {owner['pid']}" in message
        assert first.wait(timeout=300) == 0
    assert (ckpt / "latest").read_text().strip() == "step-00000008"
    assert not (ckpt / ".lock").exists()

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no live process
    dead = gone.pid
    (ckpt / ".lock").write_text(json.dumps({**owner, "pid": dead, "start": "0"}))
    resumed = run(gpt2_pipe, *STEPS, "--steps", "8", "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "took over the stale lock" in resumed.stdout
    assert not (ckpt / ".lock").exists()
    # the run it resumes had trained every step asked for: it says so, and trains none
    assert "at or past --steps 8: nothing is left to train" in resumed.stdout
    assert "step 8 loss" not in resumed.stdout


def test_lock_of_another_host_is_respected(tmp_path):
    lock = RunLock(tmp_path)
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": "1"}))
    with pytest.raises(PipelineRunError, match="pid 1 on elsewhere .* delete .*\\.lock"):
        lock.acquire()
    (tmp_path / ".lock").unlink()
    assert lock.acquire() is None and lock.held
    with pytest.raises(PipelineRunError, match="in use"):
        RunLock(tmp_path).acquire()  # the same process, a second run: refused too
    lock.release()
    assert not (tmp_path / ".lock").exists()


def _mount_small_disk(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    return done.returncode == 0


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(gpt2_pipe, tmp_path):
    """--checkpoint-dir on a tiny file system: the first checkpoint fits, the second fills the
    disk part-way. The run stops saying so, the first checkpoint stays latest and loads, no
    partial directory and no lock are left."""
    disk = tmp_path / "disk"
    if not _mount_small_disk(disk, "1200k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        ckpt = disk / "ckpt"
        result = run(
            gpt2_pipe, *STEPS, "--steps", "4", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "1", "--keep-checkpoints", "0",
        )  # fmt: skip
        message = error_of(result, gpt2_pipe)
        assert "the checkpoint of step 2 could not be written" in message
        assert "is full" in message and "step-00000001 is still the latest" in message
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001"]
        state, manifest = train_state.merge_checkpoint(ckpt)
        assert manifest["step"] == 1
        load_example(spec("gpt2")).model.load_state_dict(state)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)])  # mapped checkpoint files may be open


def test_injected_write_error_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, single_process_group
):
    """The same fault injected in-process (every DCP write fails), where no tmpfs can be
    mounted: the error names the step and the kept checkpoint; the next save works."""
    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    package = load_pipeline(out)
    stages, optimizers = training_state(package, 2)
    root = tmp_path / "ckpt"
    checkpoints = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=3)
    checkpoints.save(1, stages, optimizers)

    class FullDisk(train_state.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_state, "FileSystemWriter", FullDisk)
    with pytest.raises(
        PipelineRunError, match="step 2 could not be written .*No space left"
    ) as caught:
        checkpoints.save(2, stages, optimizers)
    assert "step-00000001 is still the latest checkpoint" in str(caught.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
    monkeypatch.undo()
    assert checkpoints.save(2, stages, optimizers) == root / "step-00000002"


def test_a_stop_signal_during_publishing_leaves_latest_complete(
    tmp_path, monkeypatch, single_process_group
):
    """SIGINT arriving while ``latest`` is being replaced (the moment the first CI run of the
    Ctrl-C test hit) stops the run only after the renames: ``latest`` names a complete step.
    The signal reaches another thread, as a signal sent to a process may (gloo's and DCP's
    threads run beside the main one): Python still runs its handler in the main thread."""
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    stages, optimizers = training_state(package, 2)
    root = tmp_path / "ckpt"
    checkpoints = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=0)
    checkpoints.save(1, stages, optimizers)
    fsync = train_state._fsync

    def interrupted_after_the_pointer(path):
        fsync(path)
        if path == root:  # `latest` was just replaced
            signal.pthread_kill(other.ident, signal.SIGINT)
            time.sleep(0.1)  # Python's handler runs in the main thread meanwhile

    monkeypatch.setattr(train_state, "_fsync", interrupted_after_the_pointer)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoints.save(2, stages, optimizers)
    finally:
        idle.set()
        signal.signal(signal.SIGINT, before)
    assert train_state.merge_checkpoint(root)[1]["step"] == 2


def test_a_stop_signal_while_a_rank_writes_waits_for_the_write(
    tmp_path, monkeypatch, single_process_group
):
    """SIGINT while torch.save writes a rank's file (what CI's Ctrl-C run met: the zip writer,
    interrupted, reported "unexpected pos" and the stop looked like a failed write): the write
    finishes, then the run stops as stopped, removing the partial checkpoint; the previous
    checkpoint stays latest."""
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    stages, optimizers = training_state(package, 2)
    root = tmp_path / "ckpt"
    checkpoints = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=0)
    checkpoints.save(1, stages, optimizers)
    save = train_state._save
    written = []

    def interrupted_while_saving(state, path):
        before = signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))
        assert before is not signal.default_int_handler  # deferred: a recorder stands in
        os.kill(os.getpid(), signal.SIGINT)
        save(state, path)
        written.append(torch.load(path, weights_only=False))  # read before the stop acts

    monkeypatch.setattr(train_state, "_save", interrupted_while_saving)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoints.save(2, stages, optimizers)
    finally:
        signal.signal(signal.SIGINT, before)
    assert written and written[0]  # whole
    assert not list(root.glob(".*partial"))  # the stopped save removed what it had written
    assert train_state.merge_checkpoint(root)[1]["step"] == 1


def test_a_stop_inside_dcp_stops_the_run(tmp_path, monkeypatch, single_process_group):
    """SIGINT while DCP writes (DCP wraps what a rank meets in a CheckpointException): the run
    stops as stopped, not as a failed write, and the previous checkpoint stays latest."""
    compile_model("mlp", tmp_path / "pipe", 2)
    stages, optimizers = training_state(load_pipeline(tmp_path / "pipe"), 2)
    root = tmp_path / "ckpt"
    package = load_pipeline(tmp_path / "pipe")
    checkpoints = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=0)
    checkpoints.save(1, stages, optimizers)

    class Interrupted(train_state.FileSystemWriter):
        def write_data(self, plan, planner):
            raise KeyboardInterrupt

    monkeypatch.setattr(train_state, "FileSystemWriter", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2, stages, optimizers)
    assert train_state.merge_checkpoint(root)[1]["step"] == 1


@pytest.mark.slow
def test_damaged_checkpoints_are_named_with_the_intact_one(gpt2_pipe, tmp_path):
    """A truncated data file in the latest checkpoint: --resume, merge and --load refuse it
    naming the file; without the `latest` pointer, --resume continues from the newest intact
    checkpoint."""
    ckpt = tmp_path / "ckpt"
    first = run(
        gpt2_pipe, *STEPS, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    stage = ckpt / "step-00000004" / "__1_0.distcp"  # rank 1's shards
    stage.write_bytes(stage.read_bytes()[:1000])

    # what --resume and --load meet, in process (how a rank's error is printed: test_failures.py)
    with pytest.raises(PipelineRunError) as resumed:
        train_state.latest_checkpoint(ckpt)
    assert "step-00000004 is damaged (__1_0.distcp has 1000 bytes" in str(resumed.value)
    assert "--resume-from step-00000002" in str(resumed.value)
    assert autopipe_main(["merge", str(ckpt), "-o", str(tmp_path / "m.pt")]) == 1
    assert not (tmp_path / "m.pt").exists()
    package = load_pipeline(gpt2_pipe)
    stages = {i: package.build_stage(i, meta_state=True) for i in range(2)}
    with pytest.raises(PipelineRunError) as loaded:
        train_state.load_weights(stages, str(stage), package.PIPELINE, torch.device("cpu"))
    assert f"--load: {stage} is not a readable torch.save checkpoint" in str(loaded.value)

    # without its `latest` pointer (step directories copied without it, a run stopped before
    # it was written), the newest checkpoint is the latest: refused as damaged, naming the
    # intact one; once that is the newest, --resume continues from it (it started over at step
    # 0 beside it) and merge reads it
    (ckpt / "latest").unlink()
    with pytest.raises(PipelineRunError) as unpointed:
        train_state.latest_checkpoint(ckpt)
    assert (
        f"{ckpt} has no latest pointer, and its newest checkpoint {ckpt}/step-00000004 is "
        "damaged (__1_0.distcp has 1000 bytes"
    ) in str(unpointed.value)
    assert "--resume-from step-00000002" in str(unpointed.value)
    shutil.rmtree(ckpt / "step-00000004")
    assert train_state.has_checkpoint(ckpt)
    assert train_state.latest_checkpoint(ckpt) == ckpt / "step-00000002"
    assert train_state.checked_checkpoint(ckpt)[0] == ckpt / "step-00000002"
    log = tmp_path / "log.jsonl"
    again = run(
        gpt2_pipe, *STEPS, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume",
        "--log-json", str(log),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt / 'step-00000002'} at step 2" in again.stdout
    assert [s for s, _ in losses(log)] == [2, 3, 4, 5]
    assert train_state.merge_checkpoint(ckpt)[1]["step"] == 6


def test_damaged_weight_files_are_named(tmp_path):
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    torch.save(state, tmp_path / "full.pt")
    save_safetensors(state, tmp_path / "full.safetensors")
    for name in ("full.pt", "full.safetensors"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut-{name}").write_bytes(data[: len(data) // 2])
        (tmp_path / f"empty-{name}").write_bytes(b"")
        for broken in (f"cut-{name}", f"empty-{name}"):
            with pytest.raises(CheckpointError, match=f"{broken}.*(truncated|not a safetensors)"):
                Checkpoint(tmp_path / broken)["w"]
    shards = tmp_path / "hf"
    shards.mkdir()
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../full.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="not a file of .* shards must lie beside the index"):
        Checkpoint(shards)


def test_merge_never_overwrites(tmp_path, single_process_group, capsys):
    """merge refuses -o inside a checkpoint's step directories and an existing file without
    --force; the checkpoint stays byte-identical."""
    compile_model("mlp", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    root = tmp_path / "ckpt"
    stages, optimizers = training_state(package, 2)
    step = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=0).save(
        1, stages, optimizers
    )
    before = {p: p.read_bytes() for p in step.iterdir()}
    assert autopipe_main(["merge", str(root), "-o", str(step / "__0_0.distcp")]) == 1
    assert autopipe_main(["merge", str(step), "-o", str(root / "latest")]) == 1
    assert autopipe_main(["merge", str(root)]) == 0  # default: ckpt/merged-step-00000001.pt
    assert (root / "merged-step-00000001.pt").is_file()
    assert autopipe_main(["merge", str(root)]) == 1
    assert autopipe_main(["merge", str(root), "--force"]) == 0
    assert {p: p.read_bytes() for p in step.iterdir()} == before
    # a later step merged by default keeps the earlier file: each is named after its step
    later = train_state.TrainingCheckpoints(root, package.PIPELINE, ONE_PROCESS, keep=0).save(
        2, stages, optimizers
    )
    assert autopipe_main(["merge", str(root)]) == 0
    assert autopipe_main(["merge", str(step)]) == 1  # step 1's file exists: --force to replace
    assert {path.name for path in root.glob("merged*")} == {
        "merged-step-00000001.pt",
        "merged-step-00000002.pt",
    }
    assert later.name == "step-00000002"
    # what is no checkpoint is named so, with the steps there are; a folder as -o asks for a file
    capsys.readouterr()
    assert autopipe_main(["merge", str(root / "step-00000009")]) == 1
    assert autopipe_main(["merge", str(tmp_path / "pipe")]) == 1
    missing, package = capsys.readouterr().err.splitlines()
    assert missing.endswith(
        f"checkpoint {root / 'step-00000009'} does not exist; {root} holds step-00000001, "
        "step-00000002"
    )
    assert "holds no checkpoint (no checkpoint.json, no latest pointer); give a" in package
    assert "damaged" not in missing + package
    # a folder as -o, existing or named with a trailing slash, is refused before anything is read
    for folder in (str(tmp_path / "pipe"), f"{tmp_path}/far/d3/"):
        with pytest.raises(SystemExit) as refused:
            autopipe_main(["merge", str(root), "-o", folder])
        assert refused.value.code == 2
        assert (
            capsys.readouterr()
            .err.rstrip()
            .endswith(
                f"argument -o/--output: {folder} is a directory; give the file to write, e.g. "
                f"{folder.rstrip('/')}/merged.pt"
            )
        )
    assert not (tmp_path / "far").exists()


@pytest.mark.slow
def test_a_large_schedule_says_what_it_is_doing(gpt2_pipe):
    result = run(gpt2_pipe, "--steps", "0", "--microbatches", "4096")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "building the 1f1b schedule of 4096 microbatches" in result.stdout
