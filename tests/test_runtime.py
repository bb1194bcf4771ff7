"""The production runtime of generated pipelines, against plain PyTorch: every schedule, pipeline
x data parallelism, gradient accumulation, clipping, learning-rate schedules, recomputation,
bf16, Dataset input, checkpoints that survive a killed rank and a crash mid-write, and merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models
from autopipe.cli import main as autopipe_main
from autopipe.compiler import CompileOptions, generate_step, trace_step
from autopipe.partitioning import Partition
from autopipe.profiling.profile import graph_digest
from autopipe.runtime import train_state
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import (
    ONE_PROCESS,
    ROOT,
    compile_model,
    run_ranks,
    spec,
    start_torchrun,
    torchrun_env,
    training_state,
)
from pipelines import (
    STEPS,
    assert_same_training,
    capacity_needing_recomputation,
    reference_training,
    run_pipeline,
)


def gpt2_reference(**options):
    return reference_training(
        load_example(spec("gpt2")), models.gpt2_batch, STEPS, "adamw", 1e-3, **options
    )


# The V-shaped schedules (zbv, dualpipev) train against PyTorch below, on V-shaped placements
# with a stage that hands back no gradient (zbv with two replicas too; and in bf16 here, sharded
# in test_data_parallel.py); GPipe on 2 ranks and 1F1B on 3 in test_training.py
# (test_gpt2_tied_weights).
@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,stages,devices",
    [
        ("interleaved-1f1b", 4, 2),
        ("looped-bfs", 4, 2),
        ("interleaved-zero-bubble", 4, 2),
        ("auto", 4, 2),
    ],
)
def test_every_schedule_trains_like_pytorch(tmp_path, schedule, stages, devices):
    """Compiled for the schedule's placement (looped, V-shaped, or Mixed-Pipe's for auto)."""
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        stages,
        "gpt2_batch",
        "--schedule",
        schedule,
        devices=devices,
        schedule=None if schedule == "auto" else schedule,
    )
    assert_same_training(pipe, gpt2_reference())


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_stage_handing_back_no_gradient_trains_under_a_split_backward(tmp_path, schedule):
    """Stage 1 here receives integer values alone (stage 0 only reshapes the token ids), so it
    hands no gradient back: torch's split backward would find its weights' gradients from what
    its input pass kept, which is nothing then (torch runs the whole backward in the weight
    pass for stage 0 alone); the runtime runs its whole backward in the input pass. Under ZBV
    with two replicas (4 processes): the tied embedding sits on one rank twice over (stages 0
    and 3), and the split backward's weight step runs before the replica all-reduce."""
    graph = trace_step(load_example(spec("gpt2")), CompileOptions(stages=4))
    labels = [u.label for u in graph.units]
    cuts = [1, labels.index("transformer.h.0.ln_1 (LayerNorm)")]
    cuts.append(next(i for i, label in enumerate(labels) if label.startswith("transformer.h.2")))
    bounds = [0, *cuts, len(labels)]
    stage_of_unit = [s for s in range(4) for _ in range(bounds[s], bounds[s + 1])]
    package = tmp_path / "pipe"
    generate_step(
        graph, Partition("manual", stage_of_unit, [0, 1, 1, 0], graph_digest(graph)), package
    )
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    assert not any(v.requires_grad for v in pipeline.received(pipeline.stages[1]))
    replicas = ("--dp", "2", "--microbatches", "2") if schedule == "zbv" else ()
    pipe = run_pipeline(tmp_path, "gpt2", 4, "gpt2_batch", "--schedule", schedule, *replicas,
                        package=package, nproc=4 if replicas else 2)  # fmt: skip
    assert_same_training(pipe, gpt2_reference())


# 2 stages x --dp 2 (4 processes, gradients averaged over replicas, tied ones summed over stages)
# trains against PyTorch in test_data_parallel.py, with accumulation and clipping besides.


@pytest.mark.slow
def test_accumulation_clipping_and_lr_schedule(tmp_path):
    """2 accumulated pipeline runs of 2 microbatches, global-norm clipping across 3 stages (the
    tied embedding counted once), linear warm-up then cosine decay: as in PyTorch."""
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        3,
        "gpt2_batch",
        "--microbatches",
        "2",
        "--accumulate",
        "2",
        "--schedule",
        "gpipe",
        "--clip-grad-norm",
        "0.3",
        "--warmup-steps",
        "2",
        "--lr-decay",
        "cosine",
        "--lr",
        "0.01",
    )
    ref = reference_training(
        load_example(spec("gpt2")),
        models.gpt2_batch,
        STEPS,
        "adamw",
        0.01,
        clip=0.3,
        warmup=2,
        cosine=True,
    )
    assert_same_training(pipe, ref)
    norms = [
        json.loads(line)["grad_norm"] for line in (tmp_path / "log.jsonl").read_text().splitlines()
    ]
    assert all(n > 0.3 for n in norms)  # the clip was active on every step


@pytest.mark.slow
def test_recomputation_keeps_results_and_batchnorm_statistics(tmp_path):
    """The BatchNorm CNN with the user's loss trains on 2 ranks (1F1B) like PyTorch; recomputing
    every stage's activations changes nothing, running statistics included: the recomputed
    forward must not update them a second time."""
    common = dict(loss="tests/models.py:cross_entropy", train_spec="cnn_with_target")
    # SGD: the bias before each BatchNorm gets a gradient of rounding noise, which AdamW would
    # turn into full-size steps
    sgd = ("--optimizer", "sgd", "--lr", "0.05")
    plain = run_pipeline(
        tmp_path / "plain", "cnn", 2, "cnn_batch", "--schedule", "1f1b", *sgd, **common
    )
    recomputed = run_pipeline(
        tmp_path / "recomputed",
        "cnn",
        2,
        "cnn_batch",
        "--schedule",
        "1f1b",
        "--recompute",
        "all",
        *sgd,
        **common,
    )
    reference = reference_training(
        load_example(spec("cnn_with_target")),
        models.cnn_batch,
        STEPS,
        "sgd",
        0.05,
        models.cross_entropy,
    )
    assert_same_training(plain, reference)  # the user's loss, BatchNorm: as in PyTorch
    assert_same_training(recomputed, plain, atol=1e-6)
    assert int(recomputed[1]["features.1.num_batches_tracked"]) == STEPS * 4


@pytest.mark.slow
def test_bf16_autocast_with_zero_bubble(tmp_path):
    """bf16 autocast (on CPU here; CUDA is the same code) under a split-backward schedule:
    values between stages keep their dtype, losses stay close to fp32's."""
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        4,
        "gpt2_batch",
        "--schedule",
        "zbv",
        "--bf16",
        "--recompute",
        "0,3",
        devices=2,
        schedule="zbv",
    )
    ref_losses, _ = gpt2_reference()
    assert pipe[0] == pytest.approx(ref_losses, rel=2e-2)
    assert all(t.dtype == torch.float32 for t in pipe[1].values() if t.is_floating_point())


@pytest.mark.slow
def test_dataset_factory(tmp_path):
    """--data FN with no arguments returns a Dataset; steps read seeded epoch permutations,
    so training matches PyTorch fed the same samples in that order."""
    dataset = models.gpt2_dataset()
    rows = models.BATCH * 4

    def batch(step):
        picks = []
        for position in range(step * rows, (step + 1) * rows):
            epoch = position // len(dataset)
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
            picks.append(dataset[int(order[position % len(dataset)])]["input_ids"])
        ids = torch.stack(picks)
        return (ids,), {"labels": ids.clone()}

    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_dataset")
    ref = reference_training(load_example(spec("gpt2")), batch, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


def _workers(parent: int) -> list[int]:
    """PIDs of the processes torchrun started."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.slow
def test_killed_rank_resumes_to_the_same_weights(tmp_path):
    """Kill one rank mid-run; --resume from the last checkpoint ends with exactly the weights
    and per-step losses of an uninterrupted run."""
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    torch.save(load_example(spec("gpt2")).model.state_dict(), tmp_path / "init.pt")
    steps = "12"
    common = ["--steps", steps, "--microbatches", "4", "--load", str(tmp_path / "init.pt")]
    common += ["--checkpoint-every", "3"]
    fast, slowly = "tests/models.py:gpt2_batch", "tests/models.py:gpt2_batch_slowly"
    full_errors = open(tmp_path / "full.err", "w")
    full_run = start_torchrun(  # the uninterrupted run, beside the one to kill
        out / "train.py",
        2,
        *common,
        "--data",
        fast,
        "--checkpoint-dir",
        str(tmp_path / "full"),
        "--save",
        str(tmp_path / "full.pt"),
        "--log-json",
        str(tmp_path / "full.jsonl"),
        stderr=full_errors,
    )

    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    errors = open(tmp_path / "killed.err", "w")
    run = start_torchrun(
        out / "train.py",
        2,
        *common,
        "--data",
        slowly,  # the same batches, late enough to kill a rank mid-run
        "--checkpoint-dir",
        str(ckpt),
        "--log-json",
        str(log),
        stderr=errors,
    )
    deadline = time.monotonic() + 300
    while not (
        (ckpt / "latest").exists() and log.exists() and len(log.read_text().splitlines()) >= 5
    ):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    os.kill(max(_workers(run.pid)), signal.SIGKILL)
    assert run.wait(timeout=120) != 0
    errors.close()
    survivor = (tmp_path / "killed.err").read_text()
    assert "train.py: rank 0 stopped" in survivor or "lost contact with another rank" in survivor
    assert "rerun with --resume" in survivor
    logged = len(log.read_text().splitlines())
    assert logged < int(steps)
    assert full_run.wait(timeout=300) == 0, (tmp_path / "full.err").read_text()[-4000:]
    full_errors.close()

    run_ranks(
        out / "train.py",
        2,
        *common,
        "--data",
        fast,
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        "--save",
        str(tmp_path / "resumed.pt"),
        "--log-json",
        str(log),
    )
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert set(full) == set(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    losses = lambda path: {
        r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())
    }  # noqa: E731
    assert losses(log) == losses(tmp_path / "full.jsonl")
    # the steps trained after the last checkpoint are trained again, and logged once
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(12))

    # autopipe merge: the checkpoint as one original-model state_dict, in both formats
    for name in ("merged.pt", "merged.safetensors"):
        assert autopipe_main(["merge", str(ckpt), "-o", str(tmp_path / name)]) == 0
    model = load_example(spec("gpt2")).model
    model.load_state_dict(torch.load(tmp_path / "merged.pt", weights_only=True))
    assert all(torch.equal(v, full[k]) for k, v in model.state_dict().items())
    from autopipe.runtime.checkpoint import Checkpoint

    merged = Checkpoint(tmp_path / "merged.safetensors")
    assert all(torch.equal(merged[k], full[k]) for k in full)


def test_checkpoint_reshards_into_another_partition(tmp_path, single_process_group):
    """A checkpoint of 2 stages fills the 3 stages of another package of the same model (DCP
    reads each name wherever it lies, the tied lm_head.weight included), optimizer state too."""
    first, second = tmp_path / "a", tmp_path / "b"
    compile_model("gpt2", first, 2)
    compile_model("gpt2", second, 3)
    a, b = load_pipeline(first), load_pipeline(second)
    stages, optimizers = training_state(a, 2)
    for index, optimizer in optimizers.items():  # a step, so AdamW has state to keep
        for p in stages[index].parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    saved = train_state.TrainingCheckpoints(tmp_path / "ckpt", a.PIPELINE, ONE_PROCESS, 0)
    path = saved.save(7, stages, optimizers)
    others = {i: b.build_stage(i, meta_state=True) for i in range(3)}
    for stage in others.values():
        train_state.materialise(stage, torch.device("cpu"))
    other_optimizers = {i: torch.optim.AdamW(m.parameters()) for i, m in others.items()}
    reader = train_state.TrainingCheckpoints(tmp_path / "ckpt", b.PIPELINE, ONE_PROCESS, 0)
    assert reader.restore(path, others, other_optimizers) == 7
    before = {k: v for m in stages.values() for k, v in m.state_dict().items()}
    after = {k: v for m in others.values() for k, v in m.state_dict().items()}
    assert set(after) <= set(before) and all(torch.equal(after[k], before[k]) for k in after)
    moments = {
        name: optimizers[i].state[p]["exp_avg"]
        for i, m in stages.items()
        for name, p in m.named_parameters()
    }
    for i, m in others.items():
        for name, p in m.named_parameters():
            assert torch.equal(other_optimizers[i].state[p]["exp_avg"], moments[name]), name


def test_checkpoint_of_another_model_is_refused(tmp_path, single_process_group):
    compile_model("gpt2", tmp_path / "a", 2)
    compile_model("mlp", tmp_path / "b", 2)
    a, b = load_pipeline(tmp_path / "a"), load_pipeline(tmp_path / "b")
    stages, optimizers = training_state(a, 2)
    path = train_state.TrainingCheckpoints(tmp_path / "ckpt", a.PIPELINE, ONE_PROCESS, 0).save(
        1, stages, optimizers
    )
    others, other_optimizers = training_state(b, 2)
    reader = train_state.TrainingCheckpoints(tmp_path / "ckpt", b.PIPELINE, ONE_PROCESS, 0)
    with pytest.raises(
        train_state.PipelineRunError, match="holds another model than SkipMLP: it has no "
    ):
        reader.restore(path, others, other_optimizers)


@pytest.mark.slow
def test_schedule_that_does_not_fit_is_named(tmp_path):
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 3)
    result = subprocess.run(
        [sys.executable, str(out / "train.py"), "--schedule", "1f1b", "--microbatches", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "needs at least as many microbatches as stages (3)" in result.stderr
    assert "--microbatches 3" in result.stderr


@pytest.mark.slow
def test_text_example_learns_from_its_dataset(tmp_path):
    """examples/text.py: a byte-level GPT-2 trained on real text through the Dataset factory;
    the loss falls well below chance (ln 256 = 5.55) within 40 steps."""
    from autopipe.compiler import CompileOptions, compile_spec

    out = tmp_path / "text"
    compile_spec("examples/text.py:build", out, CompileOptions(stages=2), report=False)
    log = tmp_path / "log.jsonl"
    run_ranks(
        out / "train.py",
        2,
        "--data",
        "examples/text.py:dataset",
        "--steps",
        "40",
        "--microbatches",
        "2",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "5",
        "--log-json",
        str(log),
    )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < 3.5
    assert all(r["tokens_per_s"] > 0 and len(r["peak_memory"]) == 2 for r in records)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_and_keeps_the_checkpoint(tmp_path):
    """SIGINT to torchrun mid-run: every rank stops within seconds, and the latest checkpoint
    is complete and loadable (an interrupted save never replaces it)."""
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    arguments = ["--steps", "500", "--microbatches", "4", "--checkpoint-every", "1"]
    arguments += ["--data", "tests/models.py:gpt2_batch_slowly"]
    arguments += ["--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    with open(tmp_path / "stderr", "w") as errors:
        run = start_torchrun(out / "train.py", 2, *arguments, stderr=errors)
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        workers = _workers(run.pid)
        run.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        assert run.wait(timeout=60) != 0
    assert time.monotonic() - stopped < 60
    said = (tmp_path / "stderr").read_text()
    assert "stopped (SIGINT" in said or "stopped (SIGTERM" in said, said[-3000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    state, manifest = train_state.merge_checkpoint(ckpt)
    assert manifest["step"] >= 2
    load_example(spec("gpt2")).model.load_state_dict(state)


@pytest.mark.slow
def test_partitioner_switches_on_recomputation_and_train_follows(tmp_path):
    """On a device with too little memory for the activations GPipe keeps, the partition marks
    the short devices' stages for recomputation; train.py (--recompute auto) recomputes them
    and still trains exactly like PyTorch."""
    import json as json_

    from autopipe.profiling import device_spec

    # operators inline: stage boundaries may fall inside a block, as the memory bound assumes
    # GPipe keeps all 4 microbatches' activations: recomputing a stage whole keeps its inputs
    roomy = compile_model("gpt2", tmp_path / "roomy", 2, inline_blocks=True, schedule="gpipe")
    spec_file = tmp_path / "small.json"
    memory = capacity_needing_recomputation(roomy, "gpipe", whole_stages=True)
    small = device_spec("h100").to_json() | {"name": "small", "memory": memory}
    spec_file.write_text(json_.dumps(small))
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", device_spec=str(spec_file), inline_blocks=True,
        schedule="gpipe",
    )  # fmt: skip
    assert Pipeline.from_json(load_pipeline(tmp_path / "pipe").PIPELINE).recomputed
    assert_same_training(pipe, gpt2_reference())


@pytest.mark.slow
def test_two_nodes_with_torchrun_rendezvous(tmp_path):
    """`torchrun --nnodes 2` as a cluster runs it (here two launchers on one machine, meeting at
    a c10d rendezvous): 2 stages x 2 replicas over 2 "nodes" train like PyTorch."""
    import socket

    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    torch.save(load_example(spec("gpt2")).model.state_dict(), tmp_path / "init.pt")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launchers = []
    for node in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=2",
        ]
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test"]
        command += [str(out / "train.py"), "--device", "cpu", "--dp", "2", "--microbatches", "2"]
        command += ["--steps", str(STEPS), "--data", "tests/models.py:gpt2_batch"]
        command += ["--load", str(tmp_path / "init.pt"), "--save", str(tmp_path / "trained.pt")]
        command += ["--log-json", str(tmp_path / "log.jsonl")]  # the same command on every node
        launchers.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=torchrun_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [launcher.communicate(timeout=600)[0] for launcher in launchers]
    assert all(launcher.returncode == 0 for launcher in launchers), "\n".join(
        o[-3000:] for o in outputs
    )
    log = (tmp_path / "log.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in log]
    state = torch.load(tmp_path / "trained.pt", weights_only=True)
    assert_same_training((losses, state), gpt2_reference())
