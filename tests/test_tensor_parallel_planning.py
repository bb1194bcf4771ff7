"""Tensor parallelism planned (autopipe/partitioning/tensor_parallel.py, issue 45 item 3): the
profile each tensor-parallel rank runs (its sharded work divided, its all-reduces added, its
parameters divided) against hand-computed figures; the search over degrees; the plan table's
``tp`` column; ``--tp`` recorded by the compile and shown in its summary."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from autopipe.compiler import CompileOptions, load_graph, tensor_parallel_degrees
from autopipe.partitioning.network import Network
from autopipe.partitioning.search import candidates, plan_table, search
from autopipe.partitioning.tensor_parallel import LOSS_REDUCTIONS, sharded_profile
from autopipe.profiling import profile
from autopipe.profiling.devices import RateTable, device_spec
from autopipe.tensor_parallel import find_regions, sharding_plan

from conftest import compile_model

LLAMA = "tests/causal_models.py:llama_plain"
UNPADDED = "tests/causal_models.py:llama_unpadded"  # its embedding sharded too


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return compile_model(LLAMA, tmp_path_factory.mktemp("tp-plan") / "pipe", 2, tp=2)


def test_a_rank_runs_its_share_and_the_all_reduces(llama):
    graph = load_graph(llama.out / "artifacts/graph.json")
    base = profile(graph, "analytic", device_spec("H100"))
    plan = sharding_plan(graph, find_regions(graph), 2)
    network = Network(base.device, 8)
    sharded, cost = sharded_profile(graph, base, plan, network)
    block = [
        i for i, u in enumerate(graph.units) if u.label.split(" ")[0].startswith("model.layers.0")
    ]
    before, after = (
        {
            key: sum(getattr(p.units[i], key) for i in block)
            for key in ("forward", "backward", "parameters", "flops_forward")
        }
        for p in (base, sharded)
    )
    # the block's row projections' outputs (o_proj, down_proj: 2 x 12 x 32 float32) are
    # all-reduced in the forward, its 2 region inputs' gradients in the backward (one for the
    # 3 projections of attention, one for the 2 of the MLP)
    hidden = 2 * 12 * 32 * 4
    reduce = network.collective("all_reduce", hidden, [0, 1])
    assert before["forward"] / 2 < after["forward"] - 2 * reduce < before["forward"]
    assert before["backward"] / 2 < after["backward"] - 2 * reduce < before["backward"]
    # 4 blocks; the head's input gradient all-reduced, and its loss computed over the
    # vocabulary's splits: 3 all-reduces of a float a row (2 x 12), no logits gathered
    assert plan.loss_parallel
    loss = LOSS_REDUCTIONS * network.collective("all_reduce", 2 * 12 * 4, [0, 1])
    assert math.isclose(cost.communication, 4 * 4 * reduce + reduce + loss)
    # q 32x32, k 16x32, v 16x32, o 32x32, gate/up 64x32, down 32x64: float32, half on each rank
    projections = (32 * 32 * 2 + 16 * 32 * 2 + 64 * 32 * 3) * 4
    assert before["parameters"] - after["parameters"] == projections // 2
    assert after["flops_forward"] == before["flops_forward"]  # the model's FLOPs, for MFU
    head = 100 * 32 * 4  # lm_head, sharded over the vocabulary
    assert math.isclose(cost.parameters_saved, (4 * projections + head) / 2)  # 4 blocks
    assert cost.communication > 0 and cost.compute_saved > 0
    assert "tensor parallel 2 saves" in cost.describe()


def test_replicated_key_value_heads_are_held_whole_and_computed_a_head_a_rank(llama):
    """At degree 4 the 2 key/value heads are replicated: each rank holds the key and value
    projections whole (no parameters saved on them) and computes one of their 2 heads (half
    their product), the query and the rest a quarter; the collectives are those of any
    degree (the key and value input gradients join the region input's all-reduce)."""
    graph = load_graph(llama.out / "artifacts/graph.json")
    base = profile(graph, "analytic", device_spec("H100"))
    plan = sharding_plan(graph, find_regions(graph), 4)
    assert sorted({m.module.rsplit(".", 1)[-1] for m in plan.modules if m.heads}) == [
        "k_proj",
        "v_proj",
    ]
    network = Network(base.device, 8)
    sharded, cost = sharded_profile(graph, base, plan, network)
    units = {u.label.split(" ")[0]: i for i, u in enumerate(graph.units)}
    for name, parts in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2)):  # no forward collective
        i = units[f"model.layers.0.self_attn.{name}"]
        assert math.isclose(sharded.units[i].forward, base.units[i].forward / parts)
    # q, o: 32x32, gate/up 64x32, down 32x64 split over 4 ranks; k and v (16x32) whole
    split = (32 * 32 * 2 + 64 * 32 * 3) * 4
    head = 100 * 32 * 4
    assert math.isclose(cost.parameters_saved, (4 * split + head) * 3 / 4)
    reduce = network.collective("all_reduce", 2 * 12 * 32 * 4, [0, 1, 2, 3])
    loss = LOSS_REDUCTIONS * network.collective("all_reduce", 2 * 12 * 4, [0, 1, 2, 3])
    assert math.isclose(cost.communication, 4 * 4 * reduce + reduce + loss)


def test_sequence_parallel_trades_all_reduces_for_halves_and_divides_the_rest(tmp_path):
    """The Llama without a padding token, sequence parallel: each all-reduce becomes a
    reduce-scatter and an all-gather (the same bytes over the ring, in two collectives), the
    norms and residual additions run on half the positions, their activations halved too."""
    compiled = compile_model(UNPADDED, tmp_path / "pipe", 1, tp=2)
    graph = load_graph(compiled.out / "artifacts/graph.json")
    base = profile(graph, "analytic", device_spec("H100"))
    network = Network(base.device, 8)
    regions = find_regions(graph)
    (on, on_cost), (off, off_cost) = (
        sharded_profile(graph, base, sharding_plan(graph, regions, 2, sequence), network)
        for sequence in (True, False)
    )
    hidden = 2 * 12 * 32 * 4
    scatter, gather = (
        network.collective(k, hidden, [0, 1]) for k in ("reduce_scatter", "all_gather")
    )
    reduce = network.collective("all_reduce", hidden, [0, 1])
    loss = LOSS_REDUCTIONS * network.collective("all_reduce", 2 * 12 * 4, [0, 1])
    # per block, 2 region inputs and 2 rows, each a collective forward and one backward
    # (4 x 4), the embedding's output and the head's input: 18 each way; the loss computed
    # over the vocabulary's splits
    assert math.isclose(on_cost.communication, 18 * (scatter + gather) + loss)
    assert math.isclose(off_cost.communication, 18 * reduce + loss)
    assert on_cost.compute_saved > off_cost.compute_saved
    assert sum(u.activations for u in on.units) < sum(u.activations for u in off.units)


def test_smaller_products_run_at_the_calibrated_rate_of_their_size(llama):
    """A spec whose matmul table falls with the product's size: each rank's half of a
    projection takes more than half its time, as the table says (the sharded profile without
    tables halves it)."""
    graph = load_graph(llama.out / "artifacts/graph.json")
    base = profile(graph, "analytic", device_spec("H100"))
    plan = sharding_plan(graph, find_regions(graph), 2)
    falling = RateTable(((1e3, 1e11), (1e6, 1e12)))  # 10x the rate for 1000x the FLOPs
    tables = dataclasses.replace(base.device, tables={"matmul.float32": falling})
    network = Network(base.device, 8)
    plain, _ = sharded_profile(graph, base, plan, network)
    slower, _ = sharded_profile(graph, dataclasses.replace(base, device=tables), plan, network)
    projections = [i for i, u in enumerate(graph.units) if u.label.endswith("_proj (Linear)")]
    assert len(projections) == 4 * 7
    assert all(slower.units[i].forward > plain.units[i].forward for i in projections)
    # what a rank holds is not slower: its activations are the same
    assert [u.activations for u in slower.units] == [u.activations for u in plain.units]
    # a 2 x 12 x 32 x 64 product: half its FLOPs run 2 ** (1/3) times slower (log-linear)
    flops = 2 * 2 * 12 * 32 * 64
    assert math.isclose(falling.at(flops) / falling.at(flops / 2), 2 ** (1 / 3))


def test_degree_one_is_the_profile_itself(llama):
    graph = load_graph(llama.out / "artifacts/graph.json")
    base = profile(graph, "analytic", device_spec("H100"))
    same, cost = sharded_profile(
        graph, base, sharding_plan(graph, find_regions(graph), 1), Network(base.device)
    )
    assert same is base and cost.communication == 0


def test_candidates_of_each_degree_fill_the_devices():
    found = candidates(8, 16, 40, tp_degrees=(1, 2, 4))
    assert {c.tp for c in found} == {1, 2, 4}
    assert all(c.ranks * c.dp_shard * c.tp == 8 for c in found)


def test_the_search_tries_the_degrees_the_graph_allows_and_tables_them(llama):
    graph = load_graph(llama.out / "artifacts/graph.json")
    options = CompileOptions(stages=1, search=True, devices=4)
    # 4 heads, 2 key/value heads: replicated at 4
    assert tensor_parallel_degrees(graph, options) == (1, 2, 4)
    assert tensor_parallel_degrees(graph, CompileOptions(stages=1, tp=2)) == (2,)
    prof = profile(graph, "analytic", device_spec("H100"))
    plans = search(graph, prof, 4, global_batch=8, method="dp", tp_degrees=(1, 2), prune=False)
    assert {p.candidate.tp for p in plans if p.fits} == {1, 2}
    table = plan_table([p.to_json() for p in plans])
    assert table.splitlines()[0].split()[:3] == ["#", "tp", "dp-shard"]
    tp_plan = next(p for p in plans if p.fits and p.candidate.tp == 2)
    assert tp_plan.partition.settings.tp == 2 and tp_plan.partition.settings.gpus_per_node == 8
    assert tp_plan.to_json()["tp"] == 2


def test_the_compile_records_the_degree_and_says_what_it_shards(llama):
    settings = json.loads((llama.out / "artifacts/partition.json").read_text())["settings"]
    assert settings["tp"] == 2
    from autopipe.report.summary import format_partition

    graph = load_graph(llama.out / "artifacts/graph.json")
    summary = format_partition(graph, llama.partition)
    assert "tensor parallel 2: 9 region(s) sharded (29 projections" in summary
    assert "model.embed_tokens is not a plain embedding (padding index" in summary
    assert "on 4 devices" in summary  # 2 pipeline ranks x tp 2


def test_a_searched_compile_says_why_it_chose_its_degree(tmp_path):
    """The search records the best plan of each degree it tried; the summary compares them."""
    from autopipe.report.summary import tensor_parallel_choice_lines

    result = compile_model(LLAMA, tmp_path / "pipe", 1, search=True, devices=4)
    degrees = {plan.get("tp", 1) for plan in result.partition.settings.plans}
    assert degrees == {1, 2, 4}  # 4: the key/value heads replicated
    (line,) = tensor_parallel_choice_lines(result.partition)
    chosen = result.partition.settings.tp or 1
    assert line.startswith(f"tensor-parallel degree {chosen} chosen: ")
    assert all(f"tp {other}: " in line for other in degrees - {chosen})
