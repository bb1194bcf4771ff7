"""``train.py --dry-run`` (runtime/dry_run.py): one process plays the ranks of a whole job on
fake tensors of ``--device cuda`` (no GPU here) and a fake process group, running the driver's
own phases: the mesh, the rank's stages (FSDP2-sharded), the schedule, the optimizer and 2 full
steps; each rank's fake-measured peak against the plan's, its collectives, and its error with
the action and generated line it happened at.

The ranks are played in this process, through the package's own runtime (as its train.py runs
it); one test starts train.py itself, as the contract says a user does. Packages: the committed
gallery's GPT-2 (4 stages) and --dynamic finetune pipeline, as they are; a zoo Llama compiled
into 4 stages looped on 2 ranks for interleaved 1F1B; the 4 models of benchmarks/prediction.py,
compiled for a calibrated CPU spec, each once per module.
"""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model
from pipelines import play, problems

GALLERY = ROOT / "generated"
#: a CPU spec as `autopipe calibrate` measured this machine (README, "Big models on a small
#: machine"): named like calibrate names one, so train.py shows MFU against it
CPU_SPEC = {
    "name": "cpu-2-cores",
    "flops": {"float32": 91.3e9, "bfloat16": 20e9, "float16": 5e9, "default": 91.3e9},
    "memory_bandwidth": 28.8e9,
    "memory": 16e9,
    "link_bandwidth": 2e9,
    "link": "measured: gloo",
    "compute_efficiency": 1.0,
    "memory_efficiency": 1.0,
    "kernel_overhead": 2.9e-6,
    "device_type": "cpu",
}


@pytest.fixture(scope="module")
def gpt2():
    return load_pipeline(GALLERY / "gpt2_4")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The zoo's Llama in 4 stages looped on 2 ranks (stages 0 and 2 on rank 0)."""
    out = tmp_path_factory.mktemp("llama") / "pipe"
    compile_model("tests/zoo/models.py:llama", out, 4, devices=2, schedule="interleaved-1f1b")
    return load_pipeline(out)


def test_gpt2_4_stages_x_2_shards_every_rank_on_cuda(gpt2):
    results, lines = play(
        gpt2, "--device", "cuda", "--dp-shard", "2", "--world-size", "8", "--steps", "1"
    )
    assert not problems(results), problems(results)
    assert [(r.rank, r.pp_rank, r.dp_rank, r.stages) for r in results] == [
        (rank, rank % 4, rank // 4, (rank % 4,)) for rank in range(8)
    ]
    assert [r.device for r in results] == [f"cuda:{rank}" for rank in range(8)]
    assert all(r.steps == 1 for r in results)
    for r in results:
        # FSDP2 (--gather block) gathers the block's shards for each microbatch's forward and
        # backward and reduce-scatters the gradients after each backward (8 microbatches)
        gathered = r.collectives["allgather_base"]
        assert gathered["forward"] >= 8 and gathered["backward"] >= 8
        assert r.collectives["reduce_scatter_base"]["backward"] >= 8
        assert r.collectives["allreduce"]["norm"] == 2  # over the pipeline, over the shards
        # no replicas: FSDP2 works over the shards alone (a replica dimension of 1 would make it
        # all-reduce every unit's gradients over one rank)
        assert "backward" not in r.collectives["allreduce"]
        assert r.transfers["sends"] > 0 and r.transfers["receives"] > 0
        assert r.predicted is not None and "planned for --dp-shard 1" in r.prediction_note
        assert 0.5 * r.predicted < r.peak < 2 * r.predicted
    # the replicas of a pipeline rank hold the same
    assert [r.peak for r in results[:4]] == [r.peak for r in results[4:]]
    assert any(line.startswith("faked: ") and "NCCL" in line for line in lines)
    assert lines[-1].startswith("dry run: 8 of 8 ranks ok")
    assert "1 step" in lines[0] and "each of its 8 ranks in turn" in lines[0]


def test_unsharded_gpt2_peaks_within_the_plan_on_cuda(gpt2):
    """The plan was made for this layout (4 ranks, no sharding): the fake-measured peaks are
    its prediction's, and the prediction is the compiler's own (partition.json)."""
    results, _ = play(gpt2, "--device", "cuda")
    assert not problems(results), problems(results)
    partition = json.loads((GALLERY / "gpt2_4" / "artifacts" / "partition.json").read_text())
    assert [r.predicted for r in results] == partition["predicted"]["device_memory"]
    for r in results:
        assert abs(r.peak - r.predicted) <= 0.05 * r.predicted, (r.rank, r.peak, r.predicted)
        assert r.prediction_note == ""


def test_sharded_gpt2_peaks_within_its_plan_on_cuda(tmp_path):
    """GPT-2 (the gallery's) planned for --dp-shard 2 on 2 stages, played on fake GPUs for 2
    steps: each rank's peak within 5 % of the plan's, which counts FSDP2's buffers block by
    block (its embedding, the rest of stage 0, is gathered before the first block's copy-out)
    and attention as a GPU's flash or memory-efficient kernel keeps it."""
    compiled = compile_model("examples/gpt2.py:build", tmp_path / "pipe", 2, dp_shard=2)
    package = load_pipeline(compiled.out)
    args = ("--device", "cuda", "--dp-shard", "2", "--steps", "2", "--world-size", "4")
    results, _ = play(package, *args)
    assert not problems(results), problems(results)
    for r in results:
        assert r.prediction_note == ""
        assert abs(r.peak - r.predicted) <= 0.05 * r.predicted, (r.rank, r.peak, r.predicted)


@pytest.mark.parametrize(
    "model, dp_shard",
    [
        ("examples/gpt2.py:build", 1),
        ("examples/gpt2.py:build", 2),
        ("tests/zoo/models.py:llama", 1),
    ],
    ids=["gpt2", "gpt2-sharded", "llama"],
)
def test_planned_for_bf16_peaks_within_its_plan_on_cuda(tmp_path, model, dp_shard):
    """GPT-2 compiled --bf16 (profiled under autocast as CUDA casts: its tanh GELU's chain in
    fp32, the products and attention in bf16, each weight's bf16 copy saved per microbatch)
    runs --bf16 by default; on fake GPUs, without and with FSDP2 (which gathers bf16 copies of
    the weights instead, and saves none per microbatch), each rank within 5 % of its plan; and
    the zoo's Llama (grouped heads, RMS norms, rotary tables), unsharded. The plan counts the
    values a block hands between its units that none saves (the norms' outputs, read by the
    products, which save their bf16 copies), while the block runs, when the activations after
    it are not saved yet."""
    compiled = compile_model(model, tmp_path / "pipe", 2, bf16=True, dp_shard=dp_shard)
    package = load_pipeline(compiled.out)
    assert package.PIPELINE["plan"]["bf16"] is True
    args = ("--device", "cuda", "--dp-shard", str(dp_shard), "--steps", "2")
    results, _ = play(package, *args, "--world-size", str(2 * dp_shard))
    assert not problems(results), problems(results)
    for r in results:
        assert r.half_precision > 100  # the package's default: --bf16
        assert r.prediction_note == ""
        assert abs(r.peak - r.predicted) <= 0.05 * r.predicted, (r.rank, r.peak, r.predicted)
    (fp32,), _ = play(package, *args, "--no-bf16", "--rank", "0", "--world-size", str(2 * dp_shard))
    assert fp32.half_precision == 0 and "planned for --bf16" in fp32.prediction_note


def test_llama_replicated_and_sharded_under_interleaved_1f1b(llama):
    played = []
    for rank in ("0", "7"):  # the first pipeline rank of replica 0, the last of replica 3
        results, _ = play(llama, "--device", "cuda", "--dp", "2", "--dp-shard", "2", "--rank", rank)
        played += results
    assert not problems(played), problems(played)
    first, last = played
    assert (first.pp_rank, first.dp_rank, first.stages) == (0, 0, (0, 2))
    assert (last.pp_rank, last.dp_rank, last.stages) == (1, 3, (1, 3))
    for r in played:  # HSDP: gradients reduce-scattered over the shards after each microbatch,
        # the shards accumulated and all-reduced over the replicas once a step (8 microbatches)
        scattered = r.collectives["reduce_scatter_base"]["backward"]
        assert scattered > 0 and r.collectives["allreduce"]["backward"] * 8 == scattered
    assert "loss_mean" in last.collectives["allreduce"]  # the last stage's rank averages the loss
    assert "loss_mean" not in first.collectives["allreduce"]


def test_dynamic_pipeline_on_cuda():
    """finetune_2 (--dynamic seq and batch): every rank learns each step's sizes (the
    all-reduce of the data phase) and builds its stages for them."""
    package = load_pipeline(GALLERY / "finetune_2")
    args = ("--device", "cuda", "--data", "examples/finetune.py:batches", "--microbatches", "4")
    results, _ = play(package, *args)
    assert not problems(results), problems(results)
    for r in results:
        assert r.collectives["allreduce"]["data"] == 2  # one a step
        assert "dynamic dimensions' upper bounds" in r.prediction_note


def test_bf16_autocast_on_cuda(gpt2):
    """--bf16 runs the stages under CUDA autocast: matrix products in bf16 (the same rank in
    fp32 computes nothing in half precision)."""
    (bf16,), lines = play(gpt2, "--device", "cuda", "--bf16", "--dp-shard", "2", "--rank", "5")
    (fp32,), _ = play(gpt2, "--device", "cuda", "--dp-shard", "2", "--rank", "5")
    assert bf16.ok and fp32.ok, problems([bf16, fp32])
    assert bf16.half_precision > 100 and fp32.half_precision == 0
    assert any("operators computed in bf16" in line for line in lines)
    assert "without --bf16" in bf16.prediction_note


def test_a_rank_of_512(gpt2):
    """GPT-2 4 stages x --dp-shard 128: the last rank of a 512-GPU job, played alone; its
    metrics gather a value from every rank."""
    args = ("--device", "cuda", "--dp-shard", "128", "--world-size", "512", "--rank", "511")
    (result,), _ = play(gpt2, *args, "--steps", "1")
    assert result.ok, problems([result])
    assert (result.world, result.device, result.pp_rank, result.dp_rank) == (512, "cuda:7", 3, 127)
    assert result.collectives["allgather"]["metrics"] == 3  # peak memory, state, times
    assert result.seconds < 60


def test_a_tensor_made_on_the_cpu_is_caught_and_named(tmp_path):
    package_dir = tmp_path / "gpt2_4"
    shutil.copytree(GALLERY / "gpt2_4", package_dir)
    source = (package_dir / "stage0.py").read_text().splitlines(keepends=True)
    made = next(i for i, line in enumerate(source) if "aten.arange.default(" in line)
    source[made] = source[made].replace("device=device", 'device="cpu"')
    (package_dir / "stage0.py").write_text("".join(source))
    package = load_pipeline(package_dir)
    (result,), lines = play(package, "--device", "cuda", "--rank", "0")
    assert not result.ok
    assert result.error.startswith("DeviceMismatch: ") and "mixes cpu and cuda:0" in result.error
    assert f"made at stage0.py:{made + 1}: " in result.error
    assert result.line.startswith("stage0.py:")  # the operator that mixed them
    assert result.action == "stage 0's forward of microbatch 0 (step 0)"
    assert lines[-1].endswith("FAILED: rank 0")
    (cpu,), _ = play(package, "--device", "cpu", "--rank", "0")  # right on a CPU run
    assert cpu.ok, problems([cpu])


def test_load_is_checked_for_names_and_shapes(gpt2, tmp_path):
    state = {}
    for index in range(4):  # the original model's names, from the stages
        state |= gpt2.build_stage(index).state_dict()
    torch.save(state, tmp_path / "model.pt")
    (loaded,), _ = play(
        gpt2, "--device", "cuda", "--load", str(tmp_path / "model.pt"), "--rank", "3"
    )
    assert loaded.ok, problems([loaded])
    state["transformer.wpe.weight"] = torch.zeros(3)
    torch.save(state, tmp_path / "other.pt")
    (other,), _ = play(
        gpt2, "--device", "cuda", "--load", str(tmp_path / "other.pt"), "--rank", "0"
    )
    assert other.error.startswith("PipelineRunError: --load: transformer.wpe.weight in ")
    assert "has shape [3], stage 0 expects [64, 128]" in other.error


# -- the plan's memory model at scale: the prediction.py models --------------------------------
def prediction_models() -> str:
    """The model source benchmarks/prediction.py compiles (its MODELS)."""
    tree = ast.parse((ROOT / "benchmarks" / "prediction.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["MODELS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/prediction.py has no MODELS")


@pytest.fixture(scope="module")
def prediction_packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("prediction")
    (root / "models.py").write_text(prediction_models())
    (root / "cpu.json").write_text(json.dumps(CPU_SPEC))
    packages = {}
    for model in ("gpt2", "bert", "t5", "cnn"):
        out = root / model
        compile_model(
            f"{root / 'models.py'}:{model}", out, 2, devices=2, schedule="1f1b", microbatches=4,
            accumulate=1, method="dp", device_spec=str(root / "cpu.json"),
        )  # fmt: skip
        packages[model] = load_pipeline(out)
    return packages


@pytest.mark.parametrize("model", ["gpt2", "bert", "t5", "cnn"])
def test_fake_peaks_within_10_percent_of_the_plan(prediction_packages, model):
    """benchmarks/prediction.py's models, planned for this CPU (2 stages, 1F1B, 4
    microbatches): each rank's fake-measured peak (which is a real torchrun --track-memory
    run's, to 0.1 MiB: README, "Big models on a small machine") is within 10% of the plan's.
    The CNN's last stage holds the gradients of its received inputs of one microbatch, the last
    it sent (torch's 1F1B waits for each send within the next actions): 24 MiB of 4
    microbatches' was a 16% miss while the plan kept them all to the end of the step."""
    results, _ = play(prediction_packages[model], "--device", "cpu")
    assert not problems(results), problems(results)
    for r in results:
        error = (r.peak - r.predicted) / r.predicted
        assert abs(error) <= 0.1, f"{model} rank {r.rank}: {error:+.1%} ({r.peak_at})"


# -- the contract: a user's command -------------------------------------------------------------
def test_train_py_dry_run_of_one_rank_exits_0_and_prints_both_peaks():
    result = subprocess.run(
        [
            sys.executable, str(GALLERY / "gpt2_4" / "train.py"), "--dry-run", "--device",
            "cuda", "--world-size", "8", "--rank", "3", "--dp-shard", "2",
        ],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rank = [line for line in result.stdout.splitlines() if line.startswith("rank 3 of 8")]
    assert rank and "setup and 2 steps ok" in rank[0], result.stdout
    assert "MiB of live fake tensors" in result.stdout
    assert "MiB predicted by the plan" in result.stdout
    assert "faked: " in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "8"], "--world-size describes the job a --dry-run plays"),
        (["--dry-run", "--world-size", "6"], "give --world-size 4 (a job runs whole pipelines"),
        (
            ["--dry-run", "--world-size", "8"],
            "give --world-size 4, or choose --dp x --dp-shard = 2",
        ),
        (["--dry-run", "--rank", "4"], "--rank 4 is outside the job: its 4 ranks are 0 to 3"),
        (["--dry-run", "--rank", "-1"], "--rank -1 is outside the job"),
        (["--dry-run", "--world-size", "0"], "--world-size must be >= 1"),
    ],
)
def test_bad_dry_run_options_are_refused(gpt2, argv, message, capsys):
    options = importlib.import_module(f"{gpt2.__name__}.runtime.options")
    pipeline = importlib.import_module(f"{gpt2.__name__}.runtime.core.pipeline")
    with pytest.raises(SystemExit):
        options.parse_config(argv, pipeline.Pipeline.from_json(gpt2.PIPELINE))
    assert message in capsys.readouterr().err
