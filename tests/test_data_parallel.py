"""Pipeline x data parallelism with FSDP2: stages sharded over --dp-shard ranks, replicated over
--dp ranks (gradients reduced while the last backward runs), both at once (HSDP); each against
plain PyTorch on the whole batch, tied GPT-2 embeddings, accumulation and clipping included.
DCP checkpoints that resume under other pipelines of the same model and survive a rank killed
while they are written."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

import models
from autopipe.cli import main as autopipe_main
from autopipe.errors import AutopipeError
from autopipe.profiling import device_spec
from autopipe.runtime import train_state
from autopipe.runtime.options import parse_config
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.core.timeline_format import COMPUTE, UNITS, RankTimeline
from autopipe.spec import load_example

from autopipe.verify import load_pipeline

from conftest import compile_model, run_ranks, run_ranks_together, spec, torchrun_failing
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline

CLIPPED = (
    "--accumulate",
    "2",
    "--microbatches",
    "1",
    "--schedule",
    "gpipe",
    "--clip-grad-norm",
    "0.3",
)


def gpt2_reference(**options):
    return reference_training(
        load_example(spec("gpt2")), models.gpt2_batch, STEPS, "adamw", 1e-3, **options
    )


def clip_was_active(log):
    return all(json.loads(line)["grad_norm"] > 0.3 for line in log.read_text().splitlines())


def assert_unit_actions_recorded(trace, flags):
    """Per rank and traced step: gathered per block call, every forward and backward of each
    microbatch unshards every unit of its stage, and every backward reduces; gathered per
    step, each unit is unsharded, freed and reduced once; replicated, nothing is gathered or
    freed, and each unit's gradients are reduced once, after the backward."""
    per_block, per_step = "--gather" not in flags and "--dp-shard" in flags, "--gather" in flags
    for rank in range(4):
        timeline = RankTimeline.from_json((trace / f"rank{rank}.json").read_text())
        (stage,) = timeline.stages
        units = {r.unit for r in timeline.records if r.kind in UNITS}
        assert "" in units and len(units) > 1, units  # the stage's blocks and the rest
        for step in range(*timeline.steps):
            mine = [r for r in timeline.records if r.step == step]
            count = Counter((r.kind, r.unit) for r in mine if r.kind in UNITS)
            assert all(r.stage == stage for r in mine if r.kind in UNITS)
            if per_block:
                for action in (r for r in mine if r.kind in COMPUTE):
                    gathered = {
                        r.unit
                        for r in mine
                        if r.kind == "unshard"
                        and r.microbatch == action.microbatch
                        and action.start_ns <= r.start_ns <= r.end_ns <= action.end_ns
                    }
                    assert gathered == units, f"rank {rank}: {action.name}"
                assert count == {
                    (kind, unit): 4 if kind != "fsdp_reduce" else 2
                    for kind in UNITS
                    for unit in units
                }
            elif per_step:
                assert count == {(kind, unit): 1 for kind in UNITS for unit in units}
            else:
                assert count == {("fsdp_reduce", unit): 1 for unit in units}
                (dp_reduce,) = [r for r in mine if r.kind == "dp_reduce"]
                for r in mine:
                    if r.kind == "fsdp_reduce":
                        assert r.microbatch is None
                        assert dp_reduce.start_ns <= r.start_ns <= r.end_ns <= dp_reduce.end_ns


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ("--dp-shard", "2"),
        ("--dp-shard", "2", "--gather", "step"),
        ("--dp", "2", "--no-dp-overlap"),
    ],
    ids=["sharded-per-block", "sharded-per-step", "replicated-after-backward"],
)
def test_two_stages_on_two_data_parallel_ranks(tmp_path, flags):
    """4 processes, 2 per stage, each rank training on its own 2 of the step's 4 microbatches:
    sharded with parameters gathered per block call (gradients reduce-scattered every
    microbatch) or once per step (reduced once), or replicated with the reduction after the
    backward instead of during it. Traced (``--trace``): FSDP2's unshards, reshards and
    reductions of each unit are recorded where they happen, as often as the mode does them."""
    trace = tmp_path / "trace"
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", *flags, "--microbatches", "2", "--trace", str(trace),
        nproc=4,
    )  # fmt: skip
    assert_same_training(pipe, gpt2_reference())
    assert_unit_actions_recorded(trace, flags)
    package = load_pipeline(tmp_path / "pipe")
    whole = [  # bytes of a stage's parameters, gradients and AdamW moments
        4 * sum(p.numel() * p.element_size() for p in package.build_stage(i).parameters())
        for i in range(2)
    ]
    held = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])["state_bytes"]
    share = 2 if "--dp-shard" in flags else 1
    for rank, state in enumerate(held):  # rank = data-parallel rank x 2 + stage
        assert 0.95 <= state / (whole[rank % 2] / share) <= 1.05  # shards split unevenly


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--dp-shard", "--dp"])
def test_accumulation_and_clipping_across_data_parallel_ranks(tmp_path, flag):
    """2 accumulated runs of 1 microbatch on each of 2 data-parallel ranks (gradients reduced
    once, in the second run), the global norm over both stages and every shard, clipped."""
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_batch", flag, "2", *CLIPPED, nproc=4)
    assert_same_training(pipe, gpt2_reference(clip=0.3))
    assert clip_was_active(tmp_path / "log.jsonl")


@pytest.mark.slow
def test_hybrid_sharding_on_eight_processes(tmp_path):
    """--dp 2 --dp-shard 2 on 2 stages: 8 processes, each stage sharded in two and replicated
    twice (HSDP), 1F1B with two microbatches per data-parallel rank: each microbatch's
    gradients reduce-scattered over the shards, the shards accumulated, and all-reduced over
    the replicas once, in the step's last backward."""
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        2,
        "gpt2_batch_of_eight",
        "--dp",
        "2",
        "--dp-shard",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        "1f1b",
        nproc=8,
    )
    reference = reference_training(
        load_example(spec("gpt2")), models.gpt2_batch_of_eight, STEPS, "adamw", 1e-3
    )
    assert_same_training(pipe, reference)


@pytest.mark.slow
def test_bf16_sharded_with_recomputed_blocks(tmp_path):
    """--bf16 with --dp-shard 2: FSDP2's mixed precision (bf16 compute, fp32 reduction and
    stored weights), every block recomputed in backward: losses close to fp32's, weights fp32."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2",
        "--bf16", "--recompute", "blocks", nproc=4,
    )  # fmt: skip
    assert pipe[0] == pytest.approx(gpt2_reference()[0], rel=2e-2)
    assert all(t.dtype == torch.float32 for t in pipe[1].values() if t.is_floating_point())


def losses_of(log):
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.mark.slow
def test_checkpoints_reshard_across_pipelines(tmp_path):
    """Train 2 stages (contiguous DP partition) x --dp-shard 2 for 4 steps with a checkpoint
    after step 2; resume from that checkpoint in 4 stages on one replica and in 2 Mixed-Pipe
    stages x --dp 2: steps 2 and 3 have the losses of the uninterrupted run, and merge reads the
    DCP checkpoint into the original model."""
    torch.save(load_example(spec("gpt2")).model.state_dict(), tmp_path / "init.pt")
    data = ["--data", "tests/models.py:gpt2_batch", "--schedule", "gpipe"]
    first = tmp_path / "first"
    compile_model("gpt2", first, 2, method="dp")
    ckpt, log = tmp_path / "ckpt", tmp_path / "full.jsonl"
    run_ranks(
        first / "train.py", 4, *data, "--steps", "4", "--microbatches", "2", "--dp-shard", "2",
        "--load", str(tmp_path / "init.pt"), "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "2", "--log-json", str(log),
    )  # fmt: skip
    full = losses_of(log)
    assert sorted(full) == [0, 1, 2, 3]
    resumes = {
        "four": (4, ["--microbatches", "4", "--dp-shard", "1"]),
        "replicated": (2, ["--microbatches", "2", "--dp", "2", "--dp-shard", "1"]),
    }
    runs = []
    for name, (stages, flags) in resumes.items():
        package = tmp_path / name
        compile_model("gpt2", package, stages, dp_shard=2)
        shutil.copytree(ckpt, tmp_path / f"{name}-ckpt")
        runs.append((package / "train.py", 4, [
            *data, *flags, "--steps", "4", "--checkpoint-dir", str(tmp_path / f"{name}-ckpt"),
            "--resume-from", "step-00000002", "--log-json", str(tmp_path / f"{name}.jsonl"),
        ]))  # fmt: skip
    for name, result in zip(resumes, run_ranks_together(*runs)):
        resumed_log = tmp_path / f"{name}.jsonl"
        assert "resumed from" in result.stdout
        # planned for 2 shards, run on whole replicas: train.py says so
        assert "planned each device's memory for --dp-shard 2" in result.stdout
        assert "recompile with autopipe compile --dp-shard 1" in result.stdout
        again = losses_of(resumed_log)
        assert sorted(again) == [2, 3]
        assert [again[s] for s in (2, 3)] == pytest.approx([full[s] for s in (2, 3)], rel=1e-5)

    assert autopipe_main(["merge", str(ckpt), "-o", str(tmp_path / "merged.pt")]) == 0
    model = load_example(spec("gpt2")).model
    model.load_state_dict(torch.load(tmp_path / "merged.pt", weights_only=True))


INJECTION = """
import os, signal
from torch.distributed.checkpoint import filesystem

write_data = filesystem.FileSystemWriter.write_data


def dies_writing_step_2(self, plan, planner):
    if os.environ.get("RANK") == "1" and "step-00000002" in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return write_data(self, plan, planner)


filesystem.FileSystemWriter.write_data = dies_writing_step_2
"""


@pytest.mark.slow
def test_a_rank_killed_while_dcp_writes_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1 of 2 stages x --dp-shard 2 dies inside DCP's write of step 2 (a fault injected
    through sitecustomize): the run stops, step 1 stays latest and loads, nothing partial is
    published, and --resume finishes the run."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INJECTION)
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    ckpt = tmp_path / "ckpt"
    flags = ["--microbatches", "2", "--dp-shard", "2", "--checkpoint-dir", str(ckpt)]
    flags += ["--checkpoint-every", "1", "--steps", "3"]
    torchrun_failing(out / "train.py", 4, *flags, env={"PYTHONPATH": str(hooks)})
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert not (ckpt / "step-00000002").exists()
    state, manifest = train_state.merge_checkpoint(ckpt)
    assert manifest["step"] == 1 and manifest["dp_shard"] == 2
    load_example(spec("gpt2")).model.load_state_dict(state)
    result = run_ranks(out / "train.py", 4, *flags, "--resume")
    assert "resumed from" in result.stdout
    assert train_state.merge_checkpoint(ckpt)[1]["step"] == 3


def test_partition_planned_for_sharding_fits_where_replication_cannot(tmp_path):
    """A device smaller than one stage's replicated parameters, gradients and AdamW state: the
    replicated plan is refused with the numbers and the way out; planned with --dp-shard 4 (a
    quarter of the state per rank, plus one gathered block at a time) it fits, and the package
    records it."""
    model = "gpt2_wide_meta"
    roomy = compile_model(model, tmp_path / "roomy", 2)
    sharded = compile_model(model, tmp_path / "sharded", 2, dp_shard=4)
    replicated_state = max(4 * s.parameters for s in roomy.partition.predicted.stages)
    sharded_peak = max(sharded.partition.predicted.device_memory)
    assert sharded_peak < replicated_state
    small = device_spec("h100").to_json() | {
        "name": "small",
        "memory": (sharded_peak + replicated_state) / 2,
    }
    spec_file = tmp_path / "small.json"
    spec_file.write_text(json.dumps(small))
    with pytest.raises(
        AutopipeError,
        match=r"needs at least .*optimizer state.*--dp-shard \d+ \(\d+ devices in all",
    ):
        compile_model(model, tmp_path / "refused", 2, device_spec=str(spec_file))
    assert not (tmp_path / "refused").exists()
    fits = compile_model(model, tmp_path / "fits", 2, device_spec=str(spec_file), dp_shard=4)
    assert max(fits.partition.predicted.device_memory) <= small["memory"]
    assert json.loads((tmp_path / "fits" / "pipeline.json").read_text())["dp_shard"] == 4


@pytest.mark.slow
def test_sharded_stages_start_from_the_same_weights(tmp_path):
    """Without --load, sharded stages are built on meta, sharded, then each rank initialises
    only its shards: the weights saved equal the unsharded stages' initialisation (the
    package's ``build_stage``, which train.py's unsharded ranks run, with its seed)."""
    out = tmp_path / "pipe"
    compile_model("gpt2", out, 2)
    run_ranks(out / "train.py", 4, "--steps", "0", "--save", str(tmp_path / "sharded"),
             "--dp-shard", "2")  # fmt: skip
    sharded = torch.load(tmp_path / "sharded", weights_only=True)
    assert set(sharded) == set(load_example(spec("gpt2")).model.state_dict())
    package = load_pipeline(out)
    whole = {k: v for i in range(2) for k, v in package.build_stage(i).state_dict().items()}
    assert set(whole) <= set(sharded)
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)


@pytest.mark.slow
def test_zero_bubble_v_schedule_sharded(tmp_path):
    """ZBV (4 stages V-placed on 2 ranks, split backward) x --dp-shard 2: --gather auto keeps
    each stage gathered from the input backward to the weight pass, and training is exact."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 4, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2",
        "--schedule", "zbv", devices=2, nproc=4, schedule="zbv",
    )  # fmt: skip
    assert_same_training(pipe, gpt2_reference())


def test_gather_per_block_is_refused_under_split_backward(tmp_path, capsys):
    compile_model("gpt2", tmp_path / "pipe", 4, devices=2, schedule="zbv")
    pipeline = Pipeline.from_json(load_pipeline(tmp_path / "pipe").PIPELINE)
    assert parse_config(["--dp-shard", "2"], pipeline).gather == "step"
    with pytest.raises(SystemExit):
        parse_config(["--dp-shard", "2", "--gather", "block"], pipeline)
    assert "--gather block does not work with --schedule zbv" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_sharded_stages(tmp_path):
    """--compile with --dp-shard 2: each stage compiled whole (inductor's C++ backend on CPU),
    FSDP2's hooks on its blocks, stage 1's blocks recomputed in backward: training as in
    PyTorch (compiled kernels round differently: atol 5e-5)."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2", "--compile",
        "--recompute", "blocks:1", nproc=4,
    )  # fmt: skip
    assert_same_training(pipe, gpt2_reference(), atol=5e-5)
