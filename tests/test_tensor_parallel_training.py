"""Tensor parallelism trained (issue 45, item 2): a package compiled with ``--tp 2`` shards its
attention and MLP projections with torch's ``parallelize_module`` and trains a grouped-query
Llama like plain PyTorch: tensor parallel alone, under a pipeline (PP 2 x TP 2) and under FSDP2
(FSDP 2 x TP 2), over gloo with torchrun; its TP 2 checkpoint resumes at TP 1. The generated
code, the plan in each stage file, the collectives torch runs per block against the regions, and
the refusals of a world size or a degree that does not fit are checked in this process."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections import Counter
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import GPT2LMHeadModel

from autopipe.codegen.context import node_layout
from autopipe.codegen.package import package_files
from autopipe.compiler import CompileOptions, check_tensor_parallel, load_graph, trace_step
from autopipe.errors import AutopipeError, PartitionError
from autopipe.report.summary import format_partition
from autopipe.runtime.core.mesh import RankMesh
from autopipe.runtime.parallel import world_size_problem
from autopipe.spec import load_example
from autopipe.tensor_parallel import sharding_plan, find_regions
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, run_ranks, spec, torchrun_failing
from pipelines import (
    MICROBATCHES,
    STEPS,
    assert_same_training,
    play,
    problems,
    reference_training,
    run_pipeline,
)

VIEWS = ("aten.view.default", "aten.reshape.default")
LLAMA = "tests/causal_models.py:llama_plain"  # 4 heads, 2 key/value heads, no dropout
UNPADDED = "tests/causal_models.py:llama_unpadded"  # the same without a padding token
EXPLICIT = "tests/causal_models.py:explicit_heads"  # biased projections, views naming sizes
BATCHES = "tests/causal_models.py:llama_plain_batch"
LLAMA_70B = "tests/causal_models.py:llama_70b_shaped"  # 8 of its layers, meta weights
GPT2 = "tests/causal_models.py:gpt2_plain"  # fused c_attn, Conv1D projections, no dropout
GPT2_DROPOUT = "tests/causal_models.py:gpt2"  # the same with dropout 0.1 everywhere
TRAIN = ("--optimizer", "adamw", "--lr", "0.001")


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """The Llama in 2 stages, tensor parallel 2: 4 processes."""
    return compile_model(LLAMA, tmp_path_factory.mktemp("tp") / "pipe", 2, tp=2)


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    """The Llama without a padding token in 1 stage, tensor parallel 2: its embedding and head
    sharded over the vocabulary too."""
    return compile_model(UNPADDED, tmp_path_factory.mktemp("tp1") / "pipe", 1, tp=2)


def _reference(name):
    causal_models = importlib.import_module("causal_models")
    return reference_training(
        load_example(name), causal_models.llama_plain_batch, STEPS, "adamw", 0.001
    )


@pytest.fixture(scope="module")
def reference():
    return _reference(LLAMA)


def test_the_package_records_its_degree_and_its_plan(two_stages):
    description = json.loads((two_stages.out / "pipeline.json").read_text())
    assert description["tp"] == 2
    assert "sequence_parallel" not in description  # its embedding has a padding index
    stage = (two_stages.out / "stage0.py").read_text()
    assert "import ColwiseParallel, PrepareModuleInput, RowwiseParallel" in stage
    assert '"model.layers.0.self_attn.q_proj": ColwiseParallel(),' in stage
    assert '"model.layers.0.mlp.down_proj": RowwiseParallel(),' in stage
    assert (
        '"model.layers.0.self_attn.tensor_parallel_input": PrepareModuleInput(\n'
        "        input_layouts=(Replicate(),),"
    ) in stage
    assert "SEQUENCE_PARALLEL_PARAMETERS" not in stage
    blocks = (two_stages.out / "blocks.py").read_text()
    assert 'keep_whole(self, "self_attn.k_proj", nn.Linear(32, 16, bias=False, device="meta"))' in (
        blocks
    )
    assert 'keep_whole(self, "self_attn.tensor_parallel_input", nn.Identity())' in blocks
    # the region input's comment names it within the block: the 2 blocks share one class
    assert blocks.count("class LlamaDecoderLayer") == 1
    assert "# self_attn.tensor_parallel_input (tensor-parallel region input)" in blocks
    # the projections are called as modules, through the region's input module
    assert "mul_1_tp = self.self_attn.tensor_parallel_input(mul_1)" in blocks
    assert "linear = self.self_attn.q_proj(mul_1_tp)" in blocks
    assert "linear_1 = self.self_attn.k_proj(mul_1_tp)" in blocks
    assert "aten.linear.default" not in blocks
    launch = (two_stages.out / "launch/slurm.sbatch").read_text()
    assert "= 4 processes, the plan's 2 pipeline ranks x --dp-shard 1 x tensor parallel 2" in (
        launch
    )


def test_a_node_holds_whole_tensor_parallel_groups():
    assert node_layout(12, 8) == (2, 6)
    assert node_layout(12, 8, tp=4) == (3, 4)  # 6 per node would split a group of 4
    assert node_layout(16, 8, tp=8) == (2, 8)


def test_the_stages_compute_the_same_at_tp_1(two_stages):
    """The TP package's code is the same computation unsharded: ``autopipe verify``'s
    in-process check (outputs and gradients against the original model) passes."""
    report = verify(two_stages.out, load_example(LLAMA))
    assert report.ok, report.summary()


def test_pipeline_x_tensor_parallel_trains_like_pytorch(two_stages, tmp_path, reference):
    pipe = run_pipeline(tmp_path, LLAMA, 2, BATCHES, *TRAIN, package=two_stages.out, nproc=4)
    assert_same_training(pipe, reference)
    said = (tmp_path / "train.out").read_text()
    # rank 0's: 14 projections and 4 region inputs
    assert "18 module(s) of this rank's stages sharded over 2 ranks" in said
    assert "sequence parallel" not in said
    assert "x tensor parallel 2 on 4 devices" in said and "another layout" not in said


def test_tensor_parallel_alone_and_under_fsdp2(one_stage, tmp_path):
    """TP 2 alone, then FSDP2 over 2 shards x TP 2 (the parameters 2-D DTensors), the
    embedding and head sharded over the vocabulary, sequence parallel: the norms and residual
    additions on each rank's half of the sequence."""
    stage = (one_stage.out / "stage0.py").read_text()
    assert (
        '"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),'
        in stage
    )
    assert '"model.layers.0.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),' in stage
    # the head's logits stay split over the vocabulary to the loss (torch's loss_parallel)
    assert (
        '"lm_head": ColwiseParallel(\n        input_layouts=Shard(1), output_layouts=Shard(-1), '
        "use_local_output=False\n    ),"
    ) in stage
    assert json.loads((one_stage.out / "pipeline.json").read_text())["loss_parallel"] is True
    assert '    "model.norm.weight",\n)' in stage  # SEQUENCE_PARALLEL_PARAMETERS's last
    reference = _reference(UNPADDED)
    for run in ("alone", "fsdp"):
        (tmp_path / run).mkdir()
    trace = ("--trace", str(tmp_path / "trace"), "--trace-steps", "1:2")
    alone = run_pipeline(
        tmp_path / "alone", UNPADDED, 1, BATCHES, *TRAIN, *trace, package=one_stage.out, nproc=2
    )
    assert_same_training(alone, reference)
    # the traced step's tensor-parallel collectives, on their own track, each in its microbatch:
    # per block 2 gathers and 2 reduce-scatters each way; the embedding's reduce-scatter
    # (gather backward); the head's input gathered (reduce-scattered backward), its logits not:
    # the loss's all-reduces over the vocabulary's splits instead (the largest logit, the sum
    # of exponentials, the labels' logits)
    events = json.loads((tmp_path / "trace" / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    on_track = Counter(  # rank 0's
        e["name"]
        for e in events
        if e.get("ph") == "X" and e["pid"] == 0 and tracks.get(e["tid"]) == "tensor parallel"
    )
    blocks = 4
    for microbatch in range(MICROBATCHES):
        assert on_track[f"tp-gather mb{microbatch} s0"] == 2 * 2 * blocks + 1 + 1
        assert on_track[f"tp-reduce-scatter mb{microbatch} s0"] == 2 * 2 * blocks + 1 + 1
        assert on_track[f"tp-all-reduce mb{microbatch} s0"] == 3, on_track
    sharded = run_pipeline(
        tmp_path / "fsdp",
        UNPADDED,
        1,
        BATCHES,
        *TRAIN,
        "--dp-shard",
        "2",
        "--microbatches",
        "2",
        package=one_stage.out,
        nproc=4,
    )
    assert_same_training(sharded, reference)


def test_sequence_parallel_across_stages_and_off(tmp_path):
    """2 stages x TP 2, sequence parallel: the hidden state crosses the stage boundary as each
    rank's half of the sequence (pipeline.json's ``tp_dim``; the rotary tables whole), the
    norms' gradients summed over the ranks: trains like PyTorch. ``--sequence-parallel off``
    compiles the same model with whole values and all-reduces. Its held-out evaluation, run
    sequence parallel in eval mode, is the trained model's loss."""
    sliced = compile_model(UNPADDED, tmp_path / "sliced", 2, tp=2)
    description = json.loads((sliced.out / "pipeline.json").read_text())
    assert description["sequence_parallel"] is True
    crossing = {v: description["values"][v] for v in description["stages"][0]["outputs"]}
    assert [v.get("tp_dim") for v in crossing.values()].count(1) == 1
    hidden = next(v for v in crossing.values() if v.get("tp_dim") == 1)
    assert hidden["shape"] == [2, 12, 32]  # the whole value's; each rank holds [2, 6, 32]
    stage = (sliced.out / "stage1.py").read_text()
    assert "sequence_parallel_parameters = SEQUENCE_PARALLEL_PARAMETERS" in stage
    evaluate = ("--eval-data", BATCHES, "--eval-batches", "1", "--eval-every", "2")
    pipe = run_pipeline(
        tmp_path, UNPADDED, 2, BATCHES, *TRAIN, *evaluate, package=sliced.out, nproc=4
    )
    assert_same_training(pipe, _reference(UNPADDED))
    assert "sequence parallel" in (tmp_path / "train.out").read_text()
    # the last evaluation (held-out batch 0 after the last step) is the trained model's mean
    # microbatch loss in eval mode
    model = load_example(UNPADDED).model
    model.load_state_dict(torch.load(tmp_path / "trained.pt"))
    model.eval()
    (ids,), labels = importlib.import_module("causal_models").llama_plain_batch(0, MICROBATCHES)
    with torch.no_grad():
        held_out = torch.stack(
            [model(i, labels=l).loss for i, l in zip(ids.chunk(MICROBATCHES),
                                                     labels["labels"].chunk(MICROBATCHES))]
        ).mean()  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] == pytest.approx(held_out.item(), rel=1e-5)

    whole = compile_model(UNPADDED, tmp_path / "whole", 2, tp=2, sequence_parallel="off")
    description = json.loads((whole.out / "pipeline.json").read_text())
    assert "sequence_parallel" not in description
    assert all("tp_dim" not in v for v in description["values"].values())
    assert (
        '"model.layers.0.mlp.down_proj": RowwiseParallel(),'
        in (whole.out / "stage0.py").read_text()
    )
    summary = format_partition(whole.graph, whole.partition)
    assert "not sequence parallel: --sequence-parallel off" in summary


def test_sequence_parallel_on_is_refused_naming_the_operator(two_stages):
    """The Llama with a padding token keeps its embedding replicated, whose whole output the
    first residual addition would add to a slice: ``on`` is refused saying so; ``auto``
    leaves it off with the same reason."""
    graph = load_graph(two_stages.out / "artifacts/graph.json")
    with pytest.raises(PartitionError, match=r"--sequence-parallel on: .* whole along it \(a "
                       r"replicated region, model.embed_tokens, computes it whole"):  # fmt: skip
        check_tensor_parallel(graph, 2, True)
    assert "combines a value sliced along the sequence" in check_tensor_parallel(graph, 2).summary()
    with pytest.raises(AutopipeError, match="--sequence-parallel 'sometimes' is unknown"):
        CompileOptions(stages=2, tp=2, sequence_parallel="sometimes")
    with pytest.raises(AutopipeError, match="which --tp 1 has none of; give --tp N"):
        CompileOptions(stages=2, sequence_parallel="on")


def test_a_dynamic_sequence_is_not_sliced(tmp_path):
    """Generated code reads a dynamic sequence's size from its inputs, which sequence
    parallelism would slice: with ``--dynamic`` the package is tensor parallel without it,
    and says why."""
    compiled = compile_model(
        UNPADDED, tmp_path / "pipe", 1, tp=2, dynamic=["seq=input_ids:1,labels:1"]
    )
    assert not compiled.partition.settings.sequence_parallel
    summary = format_partition(compiled.graph, compiled.partition)
    assert "not sequence parallel: the sequence (" in summary
    assert "is a dynamic dimension (seq)" in summary


def test_the_fake_cuda_dry_run_of_a_70b_shaped_rank(tmp_path):
    """One rank of TP 8 x PP 4 x FSDP 2 (64 GPUs) of Llama-3-70B's layers on meta weights,
    played on a fake GPU: its tensor-parallel and sequence-parallel collectives (2 gathers
    along the sequence and 2 reduce-scatters per block each way, per microbatch), FSDP2's
    2-D sharding over the DTensors, and the other stages' ranks (one of every stage); over 2
    steps (the second with the optimizer's state), each rank's peak within 10 % of the plan's:
    FSDP2's gather buffers and held reduce-scatter inputs, and attention as a GPU's fused kernel
    runs it."""
    compiled = compile_model(LLAMA_70B, tmp_path / "pipe", 4, tp=8, dp_shard=2)
    description = json.loads((compiled.out / "pipeline.json").read_text())
    assert description["tp"] == 8 and description["sequence_parallel"] is True
    package = load_pipeline(compiled.out)
    blocks = [len(stage["blocks"]) for stage in description["stages"]]
    # rank (shard * 4 + pp) * 8 + tp: a rank of each stage, the last stage's the one that
    # reports (first shard, tp rank 0), stage 1's on the second shard's eighth GPU of a node
    ranks = ["0", str((4 + 1) * 8 + 7), "16", "24"]
    args = ("--device", "cuda", "--dp-shard", "2", "--world-size", "64", "--steps", "2")
    results = [play(package, *args, "--rank", rank)[0][0] for rank in ranks]
    assert not problems(results), problems(results)
    assert [r.stages for r in results] == [(0,), (1,), (2,), (3,)]
    assert results[1].device == "cuda:7"
    microbatches = 2 * description["plan"]["microbatches"]  # over the 2 steps
    for result in results:
        per_block = 2 * blocks[result.stages[0]] * microbatches
        gathered = result.collectives["all_gather_into_tensor"]
        scattered = result.collectives["reduce_scatter_tensor"]
        head = microbatches if result.stages == (3,) else 0  # its input (its logits stay split)
        embedding = microbatches if result.stages == (0,) else 0
        assert gathered["forward"] == per_block + head
        assert scattered["forward"] == per_block + embedding
        assert result.collectives["allreduce"]["partial_sum"] == 2  # once a step
        # FSDP2 gathers each unit (the blocks, and the embedding or the norm and head beside
        # them) in every forward and backward it runs in, and in no other action: each unit's
        # backward prefetches the one the stage runs next (FSDP2's own guess gathered blocks in
        # a backward for a later microbatch's forward under 1F1B: 38 and 58 on stage 1)
        units = blocks[result.stages[0]] + (result.stages[0] in (0, 3))
        fsdp = {"forward": units * microbatches, "backward": units * microbatches}
        assert dict(result.collectives["allgather_base"]) == fsdp
    # memory: the steps' peak against the plan's (setup, which makes the embedding and the head
    # whole before sharding them, peaks apart)
    first, last = results[0], results[3]
    assert first.setup_peak > first.peak and last.setup_peak > last.peak
    assert "setup peaks higher" in first.describe()[1]
    for result in results:
        off = (result.peak - result.predicted) / result.predicted
        assert -0.1 < off < 0.1, (result.rank, result.peak, result.predicted)


def test_a_world_that_does_not_fit_is_refused_naming_the_numbers(one_stage):
    result = torchrun_failing(one_stage.out / "train.py", 3, "--steps", "1")
    said = result.stdout + result.stderr
    assert "1 ranks per pipeline x --dp 1 x tp 2 = 2 processes" in said, said[-3000:]
    assert "torchrun started 3 processes" in said


def test_world_size_problem_names_the_degree():
    said = world_size_problem(6, 2, 1, 1, tp=2)
    assert "2 ranks per pipeline x --dp 1 x tp 2 = 4 processes" in said
    assert "tensor-parallel degree" in said and "--nproc-per-node=4" in said


def test_the_mesh_puts_tensor_parallel_ranks_innermost():
    mesh = RankMesh(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    assert mesh.world == 8
    assert mesh.tp_ranks(1, 0) == (2, 3)  # consecutive: one node
    assert mesh.pipeline_ranks(0, tp_rank=1) == (1, 3)
    assert mesh.coordinates(7) == {"tp": 1, "pp": 1, "dp_shard": 1, "dp_replicate": 0}
    assert mesh.place(1, 1) == RankMesh(2, 1, 2).place(1, 1)  # tensor-parallel ranks share it
    assert mesh.describe().endswith("x tp 2, outermost first")


def test_a_degree_that_shards_nothing_is_refused(tmp_path):
    graph = trace_step(load_example(spec("cnn")), CompileOptions(stages=1))  # convolutions
    with pytest.raises(PartitionError, match=r"--tp 2 shards no region of ConvNet"):
        check_tensor_parallel(graph, 2)
    with pytest.raises(AutopipeError, match="--tp 16 is more than --gpus-per-node 8"):
        CompileOptions(stages=2, tp=16)


def _block_collectives(compiled, block_name, inputs, degree=2):
    """The collectives the block ``block_name`` of ``compiled``'s stage 0 runs under torch's
    CommDebugMode on a fake ``degree``-rank group, forward and backward, by torch's name (called on
    ``inputs()``), and the plan its regions predict them from."""
    for name in [n for n in sys.modules if n.split(".")[0] == compiled.out.name]:
        del sys.modules[name]  # another fixture's package of the same name
    sys.path.insert(0, str(compiled.out.parent))
    try:
        package = importlib.import_module(compiled.out.name)
    finally:
        sys.path.pop(0)
    graph = load_graph(compiled.out / "artifacts/graph.json")
    settings = json.loads((compiled.out / "artifacts/partition.json").read_text())["settings"]
    plan = sharding_plan(
        graph, find_regions(graph), degree, settings.get("sequence_parallel", False)
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
        stage = package.build_stage(0, device="cpu")
        parallelize_module(stage, mesh, dict(stage.tensor_parallel_plan))
        block = stage.get_submodule(block_name)
        with CommDebugMode() as forward:
            out = block(*inputs())
        with CommDebugMode() as backward:
            out.sum().backward()
    finally:
        dist.destroy_process_group()
    counts = [
        {op.__name__.split(".")[0]: n for op, n in mode.get_comm_counts().items() if n}
        for mode in (forward, backward)
    ]
    return plan, counts


def _llama_block_inputs(sequence_length):
    """A Llama block's hidden state (``sequence_length`` positions) and rotary tables."""
    return lambda: (
        torch.randn(2, sequence_length, 32, requires_grad=True),
        torch.randn(2, 12, 8),
        torch.randn(2, 12, 8),
    )


def test_the_collectives_of_a_block_are_the_regions(two_stages, one_stage):
    """Without sequence parallelism the forward all-reduces once per region (its row
    projection's partial sums) and the backward once per region too (the gradient of its
    input, summed over its column projections by its input module: not once per column);
    sequence parallel, each all-reduce is an all-gather and a reduce-scatter along the
    sequence, the block's input and output half of it. As the regions predict."""
    plan, (forward, backward) = _block_collectives(
        two_stages, "model.layers.0", _llama_block_inputs(12)
    )
    regions = {m.region for m in plan.modules if m.module.startswith("model.layers.0.")}
    inputs = [i for i in plan.inputs if i.module.startswith("model.layers.0.")]
    assert plan.sequence is None and len(regions) == len(inputs) == 2
    assert forward == {"all_reduce": 2} and backward == {"all_reduce": 2}
    plan, (forward, backward) = _block_collectives(  # 12 positions, 6 a rank
        one_stage, "model.layers.0", _llama_block_inputs(6)
    )
    assert plan.sequence is not None
    assert forward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert backward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


def test_grouped_key_value_heads_replicated_at_a_degree_above_them(one_stage, tmp_path):
    """4 query heads reading 2 key/value heads at TP 4: each rank holds the key and value
    projections whole and computes the head its query heads read (the runtime's
    ReplicatedHeadsParallel), their gradients summed over the ranks once per step. Steps 0-1
    at TP 4 (sequence parallel), steps 2-3 resumed from its checkpoint at TP 2 (where they are
    split): PyTorch's losses and trained weights. A block runs the collectives of TP 2: the
    key and value projections' input gradients join the region input's one reduce-scatter."""
    four = compile_model(UNPADDED, tmp_path / "four", 1, tp=4)
    stage = (four.out / "stage0.py").read_text()
    assert '"model.layers.0.self_attn.k_proj": ReplicatedHeadsParallel(heads=2),' in stage
    assert '"model.layers.0.self_attn.q_proj": ColwiseParallel(),' in stage
    assert 'REPLICATED_HEADS_PARAMETERS = (\n    "model.layers.0.self_attn.k_proj.weight",' in stage
    assert "replicated_heads_parameters = REPLICATED_HEADS_PARAMETERS" in stage
    summary = format_partition(four.graph, four.partition)
    assert "key/value heads replicated: 8 projections of 2 head(s)" in summary
    # the fake-CUDA dry run of a rank sharing its key/value head with another: the partial
    # gradients (the norms' and the key and value projections') summed in one all-reduce
    args = ("--device", "cuda", "--world-size", "4", "--steps", "1", "--rank", "3")
    (played,) = play(load_pipeline(four.out), *args)[0]
    assert not problems([played]), problems([played])
    assert played.collectives["allreduce"]["partial_sum"] == 1
    torch.save(load_example(UNPADDED).model.state_dict(), tmp_path / "init.pt")
    common = ["--microbatches", str(MICROBATCHES), *TRAIN, "--data", BATCHES]
    common += ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]
    log = tmp_path / "log.jsonl"
    said = run_ranks(four.out / "train.py", 4, *common, "--steps", "2", "--load",
                    str(tmp_path / "init.pt"), "--log-json", str(log))  # fmt: skip
    assert "ReplicatedHeadsParallel" in said.stdout + said.stderr
    run_ranks(one_stage.out / "train.py", 2, *common, "--steps", "4", "--resume", "--log-json",
             str(log), "--save", str(tmp_path / "trained.pt"))  # fmt: skip
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    assert_same_training((losses, torch.load(tmp_path / "trained.pt")), _reference(UNPADDED))
    plan, (forward, backward) = _block_collectives(
        four, "model.layers.0", _llama_block_inputs(3), degree=4
    )
    assert [m.heads for m in plan.modules if m.module.startswith("model.layers.0.")] == [
        0, 2, 2, 0, 0, 0, 0
    ]  # fmt: skip
    assert forward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert backward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


def test_a_tp2_checkpoint_resumes_at_tp1_and_back(two_stages, tmp_path, reference):
    """Steps 0-1 at 2 stages x TP 2, step 2 at TP 1 (the same model compiled without --tp),
    step 3 at TP 2 again in 1 stage, through one checkpoint directory (DCP reshards the
    parameters and AdamW's state): the losses and trained weights of plain PyTorch's 4
    steps."""
    assert STEPS == 4
    plain = compile_model(LLAMA, tmp_path / "plain", 2)
    whole = compile_model(LLAMA, tmp_path / "whole", 1, tp=2)
    torch.save(load_example(LLAMA).model.state_dict(), tmp_path / "init.pt")
    common = ["--microbatches", str(MICROBATCHES), *TRAIN, "--data", BATCHES]
    common += ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]
    log = tmp_path / "log.jsonl"
    run_ranks(two_stages.out / "train.py", 4, *common, "--steps", "2", "--load",
             str(tmp_path / "init.pt"), "--log-json", str(log))  # fmt: skip
    run_ranks(plain.out / "train.py", 2, *common, "--steps", "3", "--resume", "--log-json",
             str(log))  # fmt: skip
    run_ranks(whole.out / "train.py", 2, *common, "--steps", "4", "--resume", "--log-json",
             str(log), "--save", str(tmp_path / "trained.pt"))  # fmt: skip
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    assert_same_training((losses, torch.load(tmp_path / "trained.pt")), reference)
    # the last checkpoint, written by 1 stage at TP 2, merged offline: the trained weights
    merged = tmp_path / "merged.pt"
    subprocess.run(
        [sys.executable, "-m", "autopipe", "merge", str(tmp_path / "ck"), "-o", str(merged)],
        check=True,
        capture_output=True,
    )
    trained, whole = torch.load(tmp_path / "trained.pt"), torch.load(merged)
    assert set(whole) == set(trained)
    assert all(torch.equal(whole[k], trained[k]) for k in trained)


def test_biased_projections_and_views_that_name_their_sizes(tmp_path):
    """A hand-written block: its views name the 4 heads and the 32 features they merge back
    into, which generated code writes -1 at TP 2 (the graph keeps them); its projections have
    biases (ColwiseParallel shards a column's, RowwiseParallel adds a row's once). Trains like
    PyTorch on 2 ranks."""
    compiled = compile_model(EXPLICIT, tmp_path / "pipe", 1, tp=2)
    graph = load_graph(compiled.out / "artifacts/graph.json")
    sizes = [n.args[1] for n in graph.calls if n.target in VIEWS]
    assert [2, 12, 4, 8] in sizes and [2, 12, 32] in sizes
    stage = (compiled.out / "stage0.py").read_text()
    assert "aten.view.default(linear, [2, 12, -1, 8])" in stage
    assert "aten.reshape.default(transpose_3, [2, 12, -1])" in stage
    causal_models = importlib.import_module("causal_models")
    reference = reference_training(
        load_example(EXPLICIT), causal_models.explicit_heads_batch, STEPS, "adamw", 0.001
    )
    pipe = run_pipeline(
        tmp_path, EXPLICIT, 1, "tests/causal_models.py:explicit_heads_batch", *TRAIN,
        package=compiled.out, nproc=2,
    )  # fmt: skip
    assert_same_training(pipe, reference)


@pytest.fixture(scope="module")
def gpt2_two_stages(tmp_path_factory):
    """GPT-2 in 2 stages, tensor parallel 2: its Conv1D projections (weights [in, out]) held as
    the runtime's TransposedLinear, its fused c_attn split section by section."""
    return compile_model(GPT2, tmp_path_factory.mktemp("gpt2tp") / "pipe", 2, tp=2)


def test_gpt2s_transposed_and_fused_projections_are_sharded(gpt2_two_stages):
    """Each block's c_attn (query, key and value side by side) is a column split section by
    section, c_proj its row; the MLP's c_fc / c_proj; the tied embedding and head stay
    replicated and the package is not sequence parallel, with the reasons. The code splits
    the fused output into 3 chunks (each rank's third of each section) and flattens positions
    with the fixed row count, the features -1."""
    out = gpt2_two_stages.out
    stage = (out / "stage0.py").read_text()
    assert '"transformer.h.0.attn.c_attn": SectionedColwiseParallel(sections=3),' in stage
    assert '"transformer.h.0.attn.c_proj": TransposedRowwiseParallel(),' in stage
    assert '"transformer.h.0.mlp.c_fc": SectionedColwiseParallel(sections=1),' in stage
    # the runtime's styles from the package's runtime, torch's region inputs from torch
    assert "from .runtime.support import (\n    SectionedColwiseParallel,\n    " in stage
    assert "from torch.distributed.tensor.parallel import PrepareModuleInput\n" in stage
    blocks = (out / "blocks.py").read_text()
    assert "from .runtime.support import Block, TransposedLinear, keep_whole" in blocks
    assert (
        'keep_whole(self, "attn.c_attn", TransposedLinear(32, 96, bias=True, device="meta"))'
        in (blocks)
    )
    assert "addmm = self.attn.c_attn(view_tp)" in blocks
    assert "split = aten.chunk.default(view_1, 3, 2)" in blocks
    assert "view_5 = aten.view.default(reshape_1, [24, -1])" in blocks
    assert "aten.addmm.default" not in blocks
    said = format_partition(gpt2_two_stages.graph, gpt2_two_stages.partition)
    assert "the runtime's for transposed or fused ones" in said
    assert "transformer.wte: transformer.wte.weight is read by more than one operator" in said
    assert "not sequence parallel: transformer.h.0.attn.c_attn (addmm) computes on the " in said
    # unsharded (TP 1), the same code is the model's computation: autopipe verify passes
    report = verify(out, load_example(GPT2))
    assert report.ok, report.summary()
    # the fake-CUDA dry run plays a rank of each stage under FSDP2 2 x TP 2 (8 GPUs): the
    # sectioned DTensors sharded again by FSDP2, a block's two all-reduces each way
    package = load_pipeline(out)
    args = ("--device", "cuda", "--dp-shard", "2", "--world-size", "8", "--steps", "1")
    results = [play(package, *args, "--rank", rank)[0][0] for rank in ("0", "3")]
    assert not problems(results), problems(results)
    microbatches = json.loads((out / "pipeline.json").read_text())["plan"]["microbatches"]
    for result in results:  # one block a stage
        assert result.collectives["all_reduce"]["forward"] == 2 * microbatches


def test_gpt2_trains_like_pytorch_in_every_layout_through_one_checkpoint(gpt2_two_stages, tmp_path):
    """Step 0 at 2 stages x TP 2, step 1 at TP 2 alone (1 stage), step 2 at TP 1 (2 stages, no
    --tp), step 3 under FSDP2 2 x TP 2, each resuming the previous one's checkpoint (DCP
    reshards; a fused projection's sections are written in the plain layout and split again on
    load): plain PyTorch's 4 losses and trained weights, saved as a Hugging Face directory
    (--save-format hf) that transformers loads. The last checkpoint, merged offline, is the
    trained weights too."""
    assert STEPS == 4
    one = compile_model(GPT2, tmp_path / "one", 1, tp=2)
    plain = compile_model(GPT2, tmp_path / "plain", 2)
    causal_models = importlib.import_module("causal_models")
    reference = reference_training(
        load_example(GPT2), causal_models.llama_plain_batch, STEPS, "adamw", 0.001
    )
    torch.save(load_example(GPT2).model.state_dict(), tmp_path / "init.pt")
    log = tmp_path / "log.jsonl"
    common = ["--microbatches", str(MICROBATCHES), *TRAIN, "--data", BATCHES, "--log-json",
              str(log), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]  # fmt: skip
    run_ranks(gpt2_two_stages.out / "train.py", 4, *common, "--steps", "1", "--load",
             str(tmp_path / "init.pt"))  # fmt: skip
    run_ranks(one.out / "train.py", 2, *common, "--steps", "2", "--resume")
    run_ranks(plain.out / "train.py", 2, *common, "--steps", "3", "--resume")
    said = run_ranks(one.out / "train.py", 4, *common, "--steps", "4", "--resume", "--dp-shard",
                    "2", "--microbatches", "2", "--save", str(tmp_path / "hf"), "--save-format",
                    "hf")  # fmt: skip
    assert "x tensor parallel 2" in said.stdout and "FSDP2" in said.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    # saved as a Hugging Face directory: transformers loads it
    trained = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    assert_same_training((losses, trained), reference)
    merged = tmp_path / "merged.pt"
    subprocess.run(
        [sys.executable, "-m", "autopipe", "merge", str(tmp_path / "ck"), "-o", str(merged)],
        check=True,
        capture_output=True,
    )
    whole = torch.load(merged)
    assert all(torch.equal(whole[k], trained[k]) for k in trained)


def test_the_collectives_of_a_gpt2_block_are_its_regions(gpt2_two_stages):
    """A GPT-2 block at TP 2 under CommDebugMode: an all-reduce per region each way (its
    Conv1D row's partial sums; its region input's gradient), as the regions predict. The
    fused c_attn's bias is whole on every rank: its gradient is each rank's share of each
    section, gathered when the optimizer reads it."""
    _, (forward, backward) = _block_collectives(
        gpt2_two_stages, "transformer.h.0", lambda: (torch.randn(2, 12, 32, requires_grad=True),)
    )
    assert forward == {"all_reduce": 2}
    assert backward == {"all_reduce": 2}


def test_dropout_inside_regions_draws_each_ranks_own_and_recomputes_alike(tmp_path):
    """GPT-2 with dropout 0.1 at TP 2: its attention's dropout (inside the sharded region) runs
    under each rank's own random stream, the residual dropouts (replicated) under the shared
    one. Recomputing every block in backward trains the same 4 steps as keeping the
    activations: the regions' streams follow from the shared state activation checkpointing
    restores."""
    compiled = compile_model(GPT2_DROPOUT, tmp_path / "pipe", 1, tp=2)
    blocks = (compiled.out / "blocks.py").read_text()
    assert "scaled_dot_product_attention = on_rank_stream(\n" in blocks
    assert "aten.scaled_dot_product_attention.default,\n" in blocks
    assert blocks.count("on_rank_stream(") == 1  # the residual dropouts are replicated
    runs = []
    for recompute in ("none", "blocks"):
        (tmp_path / recompute).mkdir()
        runs.append(
            run_pipeline(
                tmp_path / recompute,
                GPT2_DROPOUT,
                1,
                BATCHES,
                *TRAIN,
                "--recompute",
                recompute,
                package=compiled.out,
                nproc=2,
            )
        )
    (kept, kept_weights), (recomputed, recomputed_weights) = runs
    assert kept == recomputed
    assert all(torch.equal(kept_weights[k], recomputed_weights[k]) for k in kept_weights)


def test_a_loss_in_another_stage_than_the_head_gathers_the_logits(one_stage):
    """A partition that runs the cross-entropy in a later stage than the head: a value split
    over the vocabulary would cross the boundary as a DTensor, so the package gathers the
    logits for the loss there, and its summary says why."""
    graph, part = one_stage.graph, one_stage.partition
    loss = next(n.name for n in graph.calls if n.target == "aten.cross_entropy_loss.default")
    (cut,) = [u for u, unit in enumerate(graph.units) if loss in unit.nodes]
    split = dataclasses.replace(
        part,
        stage_of_unit=[0 if u < cut else 1 for u in range(len(graph.units))],
        device_of_stage=[0, 1],
        costs=None,  # not costed: the schedule's default costs
        predicted=None,
    )
    files = package_files(graph, split)
    assert '"lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),' in (
        files["stage0.py"]
    )
    assert "loss_parallel" not in json.loads(files["pipeline.json"])
    stage_of_node = {
        n: split.stage_of_unit[u] for u, unit in enumerate(graph.units) for n in unit.nodes
    }
    plan = sharding_plan(graph, find_regions(graph), 2).on_stages(stage_of_node)  # the summary's
    assert not plan.loss_parallel and not plan.loss_chain
    assert "the head's logits gathered for the loss: " in plan.summary()
    assert "runs in stage 1, the head lm_head in stage 0" in plan.summary()
    whole = package_files(graph, part)  # one stage: split to the loss
    assert json.loads(whole["pipeline.json"])["loss_parallel"] is True
