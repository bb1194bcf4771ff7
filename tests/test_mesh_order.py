"""The device mesh's order (``pipeline.json``'s ``mesh``, ``core/mesh.py``): which global ranks
a package puts next to each other. By default the pipeline innermost (a pipeline's ranks
consecutive); shards innermost, the data-parallel ranks of each stage consecutive and the
pipeline across them. The reader, the arithmetic against the mesh torch builds for every order,
a package generated shards innermost trained on 4 gloo ranks (2 stages x --dp-shard 2, tied GPT-2
embeddings) against plain PyTorch, and its dry run."""

from __future__ import annotations

import itertools
import json

import pytest
import torch.distributed as dist

from autopipe.artifacts import dumps
from autopipe.compiler import generate_step
from autopipe.runtime.core.mesh import RankMesh
from autopipe.runtime.core.pipeline import (
    MESH_DIMENSIONS,
    PIPELINE_INNERMOST,
    SHARDS_INNERMOST,
    Pipeline,
    PipelineFormatError,
)
from autopipe.runtime.core.timeline_format import RankTimeline
from autopipe.runtime.dry_run import Fakes
from autopipe.runtime.parallel import group_ranks, init_distributed
from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model
from pipelines import assert_same_training, play, problems, run_pipeline
from test_data_parallel import gpt2_reference

GALLERY = ROOT / "generated"
EVERY_ORDER = list(itertools.permutations(MESH_DIMENSIONS))


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """GPT-2 in 2 stages, generated in the default order and shards innermost (the partition's
    settings naming the order, as the planner will)."""
    root = tmp_path_factory.mktemp("mesh")
    result = compile_model("gpt2", root / "default", 2)
    shards = result.partition.with_settings(mesh=SHARDS_INNERMOST)
    generate_step(result.graph, shards, root / "shards", prof=result.profile)
    return root / "default", root / "shards"


# -- the reader ---------------------------------------------------------------------------------
def gallery_description(name="gpt2_4"):
    return json.loads((GALLERY / name / "pipeline.json").read_text())


def test_a_pipeline_without_a_mesh_reads_as_pipeline_innermost():
    """Packages compiled before the field (the committed gallery) read as the default order and
    write back byte for byte."""
    for package in sorted(p for p in GALLERY.iterdir() if (p / "pipeline.json").is_file()):
        text = (package / "pipeline.json").read_text()
        pipeline = Pipeline.from_json(json.loads(text))
        assert pipeline.mesh == PIPELINE_INNERMOST
        assert dumps(pipeline.to_json()) == text, package.name


@pytest.mark.parametrize("order", EVERY_ORDER, ids="-".join)
def test_every_mesh_order_round_trips(order):
    data = gallery_description() | {"mesh": list(order)}
    pipeline = Pipeline.from_json(data)
    assert pipeline.mesh == order
    if order == PIPELINE_INNERMOST:  # the default is left out
        assert "mesh" not in pipeline.to_json()
    else:
        assert pipeline.to_json() == data
        assert pipeline.digest() != Pipeline.from_json(gallery_description()).digest()


@pytest.mark.parametrize(
    "mesh",
    [
        ["pp", "dp_shard"],
        ["pp", "dp_shard", "dp_shard"],
        ["pp", "dp_shard", "dp_replicate", "tp"],
        ["pp", "dp_shard", "dp"],
        "pp,dp_replicate,dp_shard",
        [1, 2, 3],
        [["pp"], "dp_shard", "dp_replicate"],
        None,
    ],
)
def test_a_mesh_that_is_no_order_of_the_dimensions_is_refused(mesh):
    with pytest.raises(
        PipelineFormatError,
        match=r"pipeline\.mesh must be an order of the mesh dimensions dp_replicate, dp_shard, pp",
    ):
        Pipeline.from_json(gallery_description() | {"mesh": mesh})


# -- the arithmetic and the mesh torch builds ---------------------------------------------------
def test_shards_innermost_puts_a_stages_data_parallel_ranks_next_to_each_other():
    ranks = RankMesh(pp=4, dp_replicate=2, dp_shard=3, order=SHARDS_INNERMOST)
    default = RankMesh(pp=4, dp_replicate=2, dp_shard=3)
    for pp_rank in range(4):
        for dp_rank in range(6):
            assert ranks.global_rank(pp_rank, dp_rank) == pp_rank * 6 + dp_rank
            assert default.global_rank(pp_rank, dp_rank) == dp_rank * 4 + pp_rank
            # the place (what seeds a rank's random streams) is the same in every order
            assert ranks.place(pp_rank, dp_rank) == default.global_rank(pp_rank, dp_rank)
    assert ranks.dp_ranks(1) == (6, 7, 8, 9, 10, 11) and ranks.pipeline_ranks(1) == (1, 7, 13, 19)
    assert default.dp_ranks(1) == (1, 5, 9, 13, 17, 21)
    assert ranks.describe() == "mesh pp 4 x dp_replicate 2 x dp_shard 3, outermost first"
    with pytest.raises(ValueError, match="pipeline rank 4 is outside 0 .. 3"):
        ranks.global_rank(4, 0)
    with pytest.raises(ValueError, match="a mesh order is an order of"):
        RankMesh(pp=2, order=("pp", "dp_shard"))


@pytest.mark.parametrize("order", EVERY_ORDER, ids="-".join)
def test_every_rank_is_where_its_order_says_on_the_mesh_torch_builds(order, monkeypatch):
    """``init_distributed`` on every rank of 2 pipeline ranks x --dp 2 x --dp-shard 2 under
    torch's fake process group (as the dry run plays a rank): the mesh torch builds places each
    rank, its pipeline and its data-parallel ranks as RankMesh's arithmetic does."""
    pipeline = Pipeline.from_json(gallery_description("bert_base_2") | {"mesh": list(order)})
    ranks = RankMesh.of(pipeline, dp=2, dp_shard=2)
    monkeypatch.setenv("WORLD_SIZE", str(ranks.world))
    with Fakes("cpu", 0, ranks.world) as fakes:
        for rank in range(ranks.world):
            fakes.rank = rank
            layout = init_distributed(pipeline, "cpu", 2, 2, timeout=60)
            try:
                assert layout.rank == rank and layout.order == order
                assert layout.pp_rank == ranks.pp_rank_of(rank)
                assert layout.dp_rank == ranks.dp_rank_of(rank)
                assert group_ranks(layout.pp_group) == ranks.pipeline_ranks(layout.dp_rank)
                assert group_ranks(layout.dp_group) == tuple(sorted(ranks.dp_ranks(layout.pp_rank)))
                shards = group_ranks(layout.shard_group)
                assert [ranks.dp_rank_of(r) % 2 for r in shards] == [0, 1]
                assert {ranks.dp_rank_of(r) // 2 for r in shards} == {layout.dp_rank // 2}
            finally:
                dist.destroy_process_group()


# -- a package generated shards innermost ---------------------------------------------------------
def test_the_order_is_written_only_when_it_is_not_the_default(packages):
    default, shards = packages
    assert "mesh" not in json.loads((default / "pipeline.json").read_text())
    written = json.loads((shards / "pipeline.json").read_text())
    assert written["mesh"] == list(SHARDS_INNERMOST)
    assert Pipeline.from_json(written).mesh == SHARDS_INNERMOST


@pytest.fixture(scope="module")
def trained(packages, tmp_path_factory):
    """The shards-innermost package trained on 4 gloo ranks: 2 stages x --dp-shard 2, 2
    microbatches per data-parallel rank, traced; its losses and weights."""
    tmp_path = tmp_path_factory.mktemp("trained")
    trace = tmp_path / "trace"
    _, shards = packages
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2",
        "--trace", str(trace), nproc=4, package=shards,
    )  # fmt: skip
    return pipe, tmp_path


@pytest.mark.slow
def test_shards_innermost_trains_like_pytorch(trained):
    """Tied embeddings (stage 0's wte, stage 1's lm_head) summed over ranks 0 and 2, 1 and 3:
    training as plain PyTorch's on the whole batch."""
    pipe, _ = trained
    assert_same_training(pipe, gpt2_reference())


@pytest.mark.slow
def test_shards_innermost_places_each_stages_shards_on_consecutive_ranks(trained, packages):
    """Ranks 0 and 1 hold stage 0's shards, 2 and 3 stage 1's; each pipeline's activations go
    from rank d to rank 2 + d."""
    _, tmp_path = trained
    for rank in range(4):
        timeline = RankTimeline.from_json((tmp_path / "trace" / f"rank{rank}.json").read_text())
        assert (timeline.rank, timeline.pp_rank, timeline.dp_rank) == (rank, rank // 2, rank % 2)
        assert timeline.stages == (rank // 2,)
        sent = {r.peer for r in timeline.records if r.kind == "send_activation"}
        assert sent == ({rank + 2} if rank < 2 else set())
    # train.py's summary names the mesh
    said = (tmp_path / "train.out").read_text()
    assert "ranks on the mesh pp 2 x dp_replicate 1 x dp_shard 2, outermost first" in said
    package = load_pipeline(packages[1])
    whole = [
        4 * sum(p.numel() * p.element_size() for p in package.build_stage(i).parameters())
        for i in range(2)
    ]
    held = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])["state_bytes"]
    for rank, state in enumerate(held):  # half a stage each: stage rank // 2
        assert 0.95 <= state / (whole[rank // 2] / 2) <= 1.05


def test_a_dry_run_plays_a_rank_where_the_order_puts_it(packages):
    """Rank 1 of the shards-innermost package, played alone on fake CUDA: stage 0's second
    shard, its gradients reduce-scattered over the shards, its activations sent down its
    pipeline."""
    package = load_pipeline(packages[1])
    args = ("--device", "cuda", "--dp-shard", "2", "--steps", "1", "--rank", "1")
    (result,), lines = play(package, *args)
    assert result.ok, problems([result])
    assert (result.rank, result.pp_rank, result.dp_rank, result.stages) == (1, 0, 1, (0,))
    assert result.device == "cuda:1"
    assert result.collectives["reduce_scatter_base"]["backward"] > 0  # over its shards
    assert result.transfers["sends"] > 0 and result.transfers["receives"] > 0
    head = "rank 1 of 4 (pipeline rank 0, data-parallel rank 1, stage 0)"
    assert any(line.startswith(head) for line in lines)
    assert "mesh pp 2 x dp_replicate 1 x dp_shard 2, outermost first" in lines[0]
