"""The memory model against cases worked out by hand: what a device holds at its peak under a
schedule's own action order (in-flight microbatches of GPipe, 1F1B and a looped schedule),
gradients from the first backward on, received-input gradients to the end of the step, the
transients of a forward, a backward and the optimizer step; on traced models, saved bytes
against autograd's and what block recomputation, whole-stage recomputation and --dp-shard
change; and predicted peaks against the live-tensor peaks of real train.py runs."""

from __future__ import annotations

import json

import pytest
import torch

from autopipe.compiler import CompileOptions, profile_step, trace_step
from autopipe.partitioning.cost import OPTIMIZER_TEMPORARIES, STATE_FACTOR, CostModel
from autopipe.partitioning.simulator import schedule_orders, simulate
from autopipe.runtime.core.schedules import PipelineCosts, device_memory
from autopipe.spec import load_example

from conftest import compile_model, run_ranks, spec


def costs(stages: int, devices: list[int] | None = None, **tables) -> PipelineCosts:
    """Uniform stages (forward 1 s, backward 2 s, activations 3 B a microbatch, static 10 B),
    with the given per-stage tables."""
    per_stage = {
        k: [v] * stages if not isinstance(v, list) else v for k, v in tables.items()
    }  # fmt: skip
    return PipelineCosts(
        forward=[1.0] * stages,
        backward=[2.0] * stages,
        activations=per_stage.pop("activations", [3.0] * stages),
        static_memory=per_stage.pop("static_memory", [10.0] * stages),
        send_forward=[0.0] * (stages - 1),
        send_backward=[0.0] * (stages - 1),
        device_of_stage=devices or list(range(stages)),
        **per_stage,
    )


def peaks(schedule: str, pipeline: PipelineCosts, microbatches: int):
    simulation = simulate(schedule_orders(schedule, pipeline, microbatches), pipeline)
    return device_memory(simulation.events, pipeline)


def test_one_stage_holds_every_microbatch_then_gradients_appear_at_its_first_backward():
    """One stage, GPipe, 3 microbatches: after F0 F1 F2 it holds 3 x 3 B of activations;
    its 4 B of gradients (part of the 10 B static) appear with B0, whose transient is 2 B:
    10 + 9 + 2 = 21 B at 0B0 (F2 reaches only 6 + 9 + 1 = 16 B, the optimizer 10 + 5)."""
    pipeline = costs(
        1,
        gradients=4.0,
        transient_forward=1.0,
        transient_backward=2.0,
        transient_optimizer=5.0,
        buffers=0.0,
    )
    (peak,) = peaks("gpipe", pipeline, 3)
    assert (peak.total, peak.moment, peak.in_flight) == (21.0, "0B0", 3)
    assert (peak.state, peak.activations, peak.transient) == (10.0, 9.0, 2.0)
    # a transient forward larger than the gradients moves the peak to the last forward
    (peak,) = peaks("gpipe", costs(1, gradients=4.0, transient_forward=9.0), 3)
    assert (peak.total, peak.moment) == (10 - 4 + 9 + 9, "0F2")


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (3, 3), (2, 6)])
def test_in_flight_microbatches_one_f_one_b_holds_stages_minus_i_gpipe_all(stages, microbatches):
    for schedule, expected in (
        ("1f1b", [min(stages - i, microbatches) for i in range(stages)]),
        ("gpipe", [microbatches] * stages),
    ):
        found = peaks(schedule, costs(stages), microbatches)
        assert [p.in_flight for p in found] == expected, schedule
        assert [p.total for p in found] == [10 + 3 * n for n in expected]


def test_looped_schedule_counts_both_stages_of_a_rank():
    """Interleaved 1F1B, 4 stages looped on 2 ranks (0, 1, 0, 1), 4 microbatches: each rank's
    static memory is its two stages', and its in-flight count comes from torch's own order."""
    pipeline = costs(4, devices=[0, 1, 0, 1])
    orders = schedule_orders("interleaved-1f1b", pipeline, 4)
    found = peaks("interleaved-1f1b", pipeline, 4)
    for device, peak in enumerate(found):
        live = most = 0
        for action in orders[device]:
            live += {"F": 1, "B": -1}.get(action.kind, 0)
            most = max(most, live)
        assert peak.in_flight == most
        assert peak.total == 20 + 3 * most


def test_received_input_gradients_stay_to_the_end_of_the_step():
    """The second of 2 stages keeps each microbatch's 1 B input gradient (torch's stage holds
    them until the next step): with GPipe and 4 microbatches, 4 B at the optimizer step, whose
    6 B of temporaries make it the peak: 10 + 4 + 6 = 20 B."""
    pipeline = costs(2, activations=[0.0, 0.0], input_gradients=[0.0, 1.0], transient_optimizer=6.0)
    first, second = peaks("gpipe", pipeline, 4)
    assert (second.moment, second.input_gradients, second.total) == ("optimizer", 4.0, 20.0)
    assert (first.input_gradients, first.total) == (0.0, 16.0)


@pytest.fixture(scope="module")
def gpt2_model():
    """A 3-block GPT-2 traced and profiled, and the cost model of 2 stages under 1F1B."""
    example = load_example(spec("gpt2"))
    options = CompileOptions(stages=2)
    graph = trace_step(example, options)
    profile = profile_step(graph, options, example)
    return graph, profile


def split(model: CostModel) -> list[int]:
    """Stage 0: every unit up to the end of the second block; stage 1: the rest."""
    last = max(model.blocks["transformer.h.1"].units)
    return [0 if u <= last else 1 for u in range(model.num_units)]


def test_stage_tables_from_the_profile(gpt2_model):
    """Per microbatch: saved activations + outputs kept to the backward; buffers for every
    microbatch's received inputs and output gradients; a forward's transient is the most of its
    locals alive at once: the stage's own as it returns (its units' temporaries outside blocks,
    and values handed between units that none saves: the embeddings' sum, which the dropout
    reads and does not keep), or a block's while it runs with the stage's made before it, less
    the activations after the block (not saved yet); the optimizer's temporaries are AdamW's
    one copy."""
    graph, profile = gpt2_model
    model = CostModel(graph, profile, schedule="1f1b", microbatches=4)
    stage_of_unit = split(model)
    got = model.pipeline_costs(stage_of_unit, [0, 1])
    units = [[u for u, s in enumerate(stage_of_unit) if s == stage] for stage in (0, 1)]
    act_cross, grad_cross, outputs = model._crossing(stage_of_unit, 2)
    twice = model._counted_twice(stage_of_unit, 2)
    for s in (0, 1):
        saved = sum(model.activations[u] for u in units[s])
        assert 0 <= twice[s] < saved
        assert got.activations[s] == pytest.approx(saved - twice[s] + outputs[s])
    assert got.buffers == pytest.approx([4 * grad_cross[0], 4 * act_cross[0]])
    assert got.input_gradients == [0.0, grad_cross[0]]
    blocks = [b for b in model.blocks.values() if b.stage(stage_of_unit) == 0]
    assert [b.fqn for b in blocks] == ["transformer.h.0", "transformer.h.1"]
    in_blocks = {u for b in blocks for u in b.units}
    own = {u: 0.0 if u in in_blocks else model.temporaries[u] for u in units[0]}
    handed = [v for v in model.handed if v.block < 0 and stage_of_unit[v.producer] == 0]
    for value in handed:
        assert {stage_of_unit[r] for r in value.readers} == {0}
        own[value.producer] += value.nbytes
    assert handed  # wte + wpe, read by the dropout alone
    peaks = [sum(own.values())]  # as the stage returns
    for b in blocks:
        made = sum(n for u, n in own.items() if u < min(b.units))
        end = max(b.units)
        after = sum(model.activations[u] for u in units[0] if u > end)
        # of which the values that exist as the block ends (its output, which the next block's
        # first norm saves; the position ids) are saved already in effect
        existing = sum(
            ex.activation
            for ex in model.exchanges
            if ex.producer <= end
            for u in ex.readers
            if end < u < model.num_units and stage_of_unit[u] == 0
            if ex.name in model.saved_values[u]
        )
        assert existing > 0 or after == 0
        locals_ = sum(model.temporaries[u] for u in b.units) + model.block_locals[b.fqn]
        peaks.append(made + locals_ - (after - existing))
    assert got.transient_forward[0] == pytest.approx(max(peaks))
    params = model.stage_parameters(stage_of_unit, 2)
    assert got.static_memory == pytest.approx([STATE_FACTOR["adamw"] * p for p in params])
    assert got.gradients == pytest.approx(params)
    assert got.transient_optimizer == pytest.approx(
        [OPTIMIZER_TEMPORARIES["adamw"] * p for p in params]
    )


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_saved_bytes_of_a_whole_model_match_autograd(name):
    """One stage: the cost model's activations of a microbatch (units' saved tensors, a tensor
    saved by two units counted once) are what autograd really saves running the model, plus
    the outputs the stage keeps."""
    example = load_example(spec(name))
    options = CompileOptions(stages=1)
    graph = trace_step(example, options)
    model = CostModel(graph, profile_step(graph, options, example), microbatches=1)
    stage_of_unit = [0] * model.num_units
    kept = model._crossing(stage_of_unit, 1)[2][0]
    predicted = model.pipeline_costs(stage_of_unit, [0]).activations[0] - kept
    params = {p.untyped_storage().data_ptr() for p in example.model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    example.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        example.model(*example.args, **example.kwargs)
    assert predicted == pytest.approx(sum(saved.values()), rel=0.05)


def test_recomputation_keeps_inputs_and_rebuilds_in_backward(gpt2_model):
    """A recomputed block keeps only what it reads from outside, and its backward rebuilds its
    activations and locals (its units' temporaries and the values it hands between them); a
    recomputed stage keeps only its inputs (and its outputs)."""
    graph, profile = gpt2_model
    model = CostModel(graph, profile, schedule="1f1b", microbatches=4)
    stage_of_unit = split(model)
    plain = model.pipeline_costs(stage_of_unit, [0, 1])
    block = model.blocks["transformer.h.1"]
    one = model.pipeline_costs(stage_of_unit, [0, 1], recompute_blocks=frozenset({block.fqn}))
    kept = sum(model.activations[u] for u in block.units)
    assert one.activations[0] == pytest.approx(plain.activations[0] - (kept - block.inputs))
    again = kept + sum(model.temporaries[u] for u in block.units) + model.block_locals[block.fqn]
    assert model.block_locals[block.fqn] > 0  # values its units hand on and none saves
    assert one.transient_backward[0] == pytest.approx(max(plain.transient_backward[0], again))
    # the block before it has less not saved yet while it runs: h.1 saves its inputs alone
    assert one.transient_forward[0] >= plain.transient_forward[0]
    assert one.activations[1] == plain.activations[1]

    whole = model.pipeline_costs(stage_of_unit, [0, 1], recompute=frozenset({1}))
    act_cross, _, outputs = model._crossing(stage_of_unit, 2)
    assert whole.activations[1] == pytest.approx(act_cross[0] + outputs[1])
    saved = plain.activations[1] - outputs[1]
    assert whole.transient_backward[1] == pytest.approx(
        plain.transient_backward[1] + saved + plain.transient_forward[1]
    )
    # under 1F1B the last stage holds one microbatch: recomputing it whole only adds the
    # rebuilt forward's locals; under GPipe it holds all 4, and recomputing lowers its peak
    last = [
        [model.evaluate(stage_of_unit, schedule=schedule, recompute=r).device_memory[1]
         for r in (frozenset(), frozenset({1}))]
        for schedule in ("1f1b", "gpipe")
    ]  # fmt: skip
    assert last[0][1] >= last[0][0] and last[1][1] < last[1][0]


def test_sharding_divides_the_state_and_adds_what_fsdp_gathers(gpt2_model):
    """--dp-shard 4: parameters, gradients, AdamW state and the optimizer's temporaries per
    rank are a quarter; a stage additionally holds its parameters outside blocks and its
    largest block's gathered, each with its gradient."""
    graph, profile = gpt2_model
    whole = CostModel(graph, profile, schedule="1f1b", microbatches=4)
    sharded = CostModel(graph, profile, schedule="1f1b", microbatches=4, dp_shard=4)
    stage_of_unit = split(whole)
    params = whole.stage_parameters(stage_of_unit, 2)
    got = sharded.pipeline_costs(stage_of_unit, [0, 1])
    blocks = {s: [b for b in whole.blocks.values() if b.stage(stage_of_unit) == s] for s in (0, 1)}
    for s in (0, 1):
        sizes = [sum(whole.param_bytes[u] for u in b.units) for b in blocks[s]]
        gathered = 2 * (params[s] - sum(sizes) + max(sizes))
        assert got.static_memory[s] == pytest.approx(params[s] + gathered)  # 4 x params / 4
        assert got.gradients[s] == pytest.approx(params[s] / 4)
        assert got.transient_optimizer[s] == pytest.approx(params[s] / 4)
    assert max(sharded.evaluate(stage_of_unit).device_memory) < max(
        whole.evaluate(stage_of_unit).device_memory
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_predicted_peaks_match_the_live_tensor_peaks_of_a_run(tmp_path, schedule):
    """train.py --track-memory counts live tensor bytes operator by operator on every rank:
    each rank's peak is within 10 % of the partition's prediction."""
    out = tmp_path / "pipe"
    result = compile_model("gpt2", out, 2, schedule=schedule)
    log = tmp_path / "log.jsonl"
    run_ranks(out / "train.py", 2, "--steps", "3", "--track-memory", "--log-json", str(log))
    measured = json.loads(log.read_text().splitlines()[-1])["peak_memory"]
    predicted = list(result.partition.predicted.device_memory)
    assert predicted == pytest.approx(measured, rel=0.1)
