"""autopipe/partitioning/stage_sums.py: the cost model's per-stage sums, with numpy, equal to
the last bit to the unit-by-unit loops they replaced (kept here as the reference), for random
assignments of real models' units: contiguous, any monotone one, and any at all."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from autopipe.partitioning.cost import OPTIMIZER_TRAFFIC, CostModel
from autopipe.runtime.core.schedules import SPLIT_BACKWARD
from autopipe.profiling import profile
from autopipe.profiling.devices import RateTable
from autopipe.spec import Example, load_example
from autopipe.tracing import trace

from conftest import spec


# -- the reference: the loops as they were ---------------------------------------------------
def stage_parameters(model, stage_of_unit, num_stages, trainable=False):
    held = [{} for _ in range(num_stages)]
    for unit, stage in enumerate(stage_of_unit):
        held[stage].update(model.unit_params[unit])
    return [
        float(sum(b for name, b in params.items() if not (trainable and name in model.frozen)))
        for params in held
    ]


def trained_parameters(model, stage_of_unit, num_stages):
    """Each stage's trained parameters (bytes by name, each once)."""
    held = [{} for _ in range(num_stages)]
    for unit, stage in enumerate(stage_of_unit):
        held[stage].update(
            (n, b) for n, b in model.unit_params[unit].items() if n not in model.frozen
        )
    return held


def first_stages(model, stage_of_unit):
    """Each parameter's stage of its first reader in the model (the copy the norm counts)."""
    first = {}
    for unit, params in enumerate(model.unit_params):
        for name in params:
            first.setdefault(name, stage_of_unit[unit])
    return first


def optimizer_steps(model, stage_of_unit, num_stages):
    first = first_stages(model, stage_of_unit)
    return [
        sum(
            model.parameter_step_time(b) + (model.norm_time(b) if first[n] == s else 0.0)
            for n, b in params.items()
        )
        for s, params in enumerate(trained_parameters(model, stage_of_unit, num_stages))
    ]


def tied_accumulations(model, stage_of_unit, num_stages):
    """Each stage's trained parameters (once) whose first reader in the model is in another
    stage: their gradients added there too."""
    first_reader = {}
    for unit, params in enumerate(model.unit_params):
        for name in params:
            first_reader.setdefault(name, unit)
    added, seen = [0.0] * num_stages, set()
    for unit, params in enumerate(model.unit_params):
        s = stage_of_unit[unit]
        for name, nbytes in params.items():
            if (s, name) in seen:
                continue
            seen.add((s, name))
            if name not in model.frozen and stage_of_unit[first_reader[name]] != s:
                added[s] += model.accumulation_time(nbytes)
    return added


def crossing(model, stage_of_unit, num_stages):
    act_cross = [0.0] * max(num_stages - 1, 0)
    grad_cross = [0.0] * max(num_stages - 1, 0)
    model_outputs = 0.0
    for ex in model.exchanges:
        first = stage_of_unit[ex.producer] if ex.producer >= 0 else 0
        last = ex.last
        end = stage_of_unit[last] if last < model.num_units else num_stages - 1
        for s in range(first, end):
            act_cross[s] += ex.activation
            grad_cross[s] += ex.gradient
        if last == model.num_units:
            model_outputs += ex.activation
    return act_cross, grad_cross, [*act_cross, model_outputs]


def counted_twice(model, stage_of_unit, num_stages):
    twice = [0.0] * num_stages
    for ex, kept, recast in zip(model.exchanges, model.held_bytes, model.recast):
        home = stage_of_unit[ex.producer] if ex.producer >= 0 else -1
        savers = {}
        for unit in (ex.producer, *ex.readers):
            if 0 <= unit < model.num_units and ex.name in model.saved_values[unit]:
                stage = stage_of_unit[unit]
                savers[stage] = savers.get(stage, 0) + 1
        last = ex.last
        end = stage_of_unit[last] if last < model.num_units else num_stages
        for stage, count in savers.items():
            held = (home >= 0 and stage != home) or end > stage
            # a buffer or an output is the saved tensor where the stage holds it as it sends it
            same = held and not recast
            twice[stage] += kept * (count - 1) + (ex.activation if same else 0.0)
    return twice


def transients(model, stage_of_unit, num_stages):
    """Where FSDP2 gathers block by block, a block's forward also holds its gather's flat
    buffer (two at the next block's copy-out, before the block's activations), its backward
    the next block's gather and the previous block's gradients."""
    per_block = model.dp_shard > 1 and model.schedule not in SPLIT_BACKWARD
    forward = [0.0] * num_stages
    backward = [0.0] * num_stages
    freed = [0.0] * num_stages
    pending = [0.0] * num_stages
    extra = [0.0] * model.num_units
    opening, closing = {}, {}  # each stage's first and last whole block's first unit
    blocked = {
        u for b in model.blocks.values() if b.stage(stage_of_unit) is not None for u in b.units
    }
    trained_rest = stage_parameters(model, stage_of_unit, num_stages, True)
    params_rest = stage_parameters(model, stage_of_unit, num_stages)
    for block in model.blocks.values():
        stage = block.stage(stage_of_unit)
        if stage is not None:
            opening[stage] = min(opening.get(stage, model.num_units), min(block.units))
            closing[stage] = max(closing.get(stage, -1), min(block.units))
            trained_rest[stage] -= sum(model.trainable_bytes[u] for u in block.units)
            params_rest[stage] -= sum(model.param_bytes[u] for u in block.units)
    for block in model.blocks.values():
        stage = block.stage(stage_of_unit)
        if per_block and stage is not None:
            # FSDP2 gathers bf16 copies of fp32 parameters under --bf16
            params = sum(model.param_bytes[v] for v in block.units) * model.gather_scale
            trained = sum(model.trainable_bytes[v] for v in block.units)
            prefetched = 0.0 if min(block.units) == opening[stage] else params
            last = min(block.units) == closing[stage]
            reducing = trained_rest[stage] if last and trained_rest[stage] > 0 else trained
            not_yet = sum(
                model.trainable_bytes[u]
                for u in range(model.num_units)
                if stage_of_unit[u] == stage and u < opening[stage] and u not in blocked
            )
            for u in block.units:
                earlier = sum(model.trainable_bytes[v] for v in block.units if v < u)
                extra[u] = prefetched + reducing - not_yet - earlier
    for unit, s in enumerate(stage_of_unit):
        pending[s] += model.trainable_bytes[unit] / model.dp_shard
    for unit in reversed(range(model.num_units)):
        s = stage_of_unit[unit]
        pending[s] -= model.trainable_bytes[unit] / model.dp_shard
        beyond = model.backward_memory[unit] + extra[unit] - freed[s] - pending[s]
        backward[s] = max(backward[s], beyond)
        freed[s] += model.activations[unit]
    # the stage's own locals: its units' temporaries outside whole blocks, and the values
    # handed between units that none keeps, where one stage makes and reads them (a whole
    # block's own are the block's)
    own = [0.0 if unit in blocked else model.temporaries[unit] for unit in range(model.num_units)]
    fqns = list(model.blocks)
    block_locals = dict.fromkeys(fqns, 0.0)
    for value in model.handed:
        home = stage_of_unit[value.producer]
        if value.block >= 0 and model.blocks[fqns[value.block]].stage(stage_of_unit) is not None:
            block_locals[fqns[value.block]] += value.nbytes
        elif {stage_of_unit[r] for r in value.readers} == {home}:
            own[value.producer] += value.nbytes
    inline = [0.0] * num_stages
    largest = [0.0] * num_stages
    for unit, s in enumerate(stage_of_unit):
        inline[s] += own[unit]

    def made_before(stage, first):
        return sum(own[u] for u in range(first) if stage_of_unit[u] == stage)

    def saved_from(stage, first):
        return sum(
            model.activations[u] for u in range(first, model.num_units) if stage_of_unit[u] == stage
        )

    def existing_after(stage, end):
        """Bytes the stage's units after ``end`` save of values that exist by then."""
        total = 0.0
        for ex, kept in zip(model.exchanges, model.held_bytes):
            made_here = ex.producer >= 0 and stage_of_unit[ex.producer] == stage
            if made_here and ex.producer > end:
                continue
            for unit in (ex.producer, *ex.readers):
                if 0 <= unit < model.num_units and ex.name in model.saved_values[unit]:
                    if stage_of_unit[unit] == stage and unit > end:
                        total += kept
        return total

    for block in model.blocks.values():
        stage = block.stage(stage_of_unit)
        if stage is not None:
            # while the block runs: its locals and the stage's made before it, less the stage's
            # activations after it (not saved yet), above the stage's locals at its end
            end = max(block.units)
            held = sum(model.temporaries[u] for u in block.units) + block_locals[block.fqn]
            held += made_before(stage, min(block.units))
            held -= saved_from(stage, end + 1) - existing_after(stage, end) + inline[stage]
            if per_block:
                params = sum(model.param_bytes[u] for u in block.units) * model.gather_scale
                unheld = sum(model.trainable_bytes[u] for u in block.units)
                unheld = unheld if trained_rest[stage] > 0 else 0.0
                # the flat buffer gathered before: the rest's before the stage's first block
                first = min(block.units) == opening[stage]
                rest = max(params_rest[stage], 0.0) * model.gather_scale
                before = rest if first else params
                copy_out = before + params - saved_from(stage, min(block.units))
                copy_out += made_before(stage, min(block.units)) - inline[stage]
                held = max(held, held + params - unheld, copy_out - unheld)
            largest[stage] = max(largest[stage], held)
    for s in range(num_stages):
        forward[s] = inline[s] + largest[s]
    return forward, backward


def gathered(model, stage_of_unit, params, trainable):
    num_stages = len(params)
    if model.dp_shard == 1:
        return [0.0] * num_stages
    largest, in_blocks = [0.0] * num_stages, [0.0] * num_stages
    for block in model.blocks.values():
        stage = block.stage(stage_of_unit)
        if stage is not None:
            size = sum(
                model.param_bytes[u] * model.gather_scale + model.trainable_bytes[u]
                for u in block.units
            )
            in_blocks[stage] += size
            largest[stage] = max(largest[stage], size)
    gathered = [p * model.gather_scale for p in params]  # bf16 copies under --bf16
    return [gathered[s] + trainable[s] - in_blocks[s] + largest[s] for s in range(num_stages)]


# -- assignments ------------------------------------------------------------------------------
def contiguous(rng, n, stages):
    cuts = sorted(rng.sample(range(1, n), stages - 1))
    return [sum(u >= c for c in cuts) for u in range(n)]


def monotone(model, rng, stages):
    """Units in a random topological order of the unit DAG, cut into ``stages`` runs: a valid
    assignment that need not be contiguous in program order."""
    n = model.num_units
    indegree = {u: model.dag.in_degree(u) for u in range(n)}
    ready, order = [u for u in range(n) if indegree[u] == 0], []
    while ready:
        u = ready.pop(rng.randrange(len(ready)))
        order.append(u)
        for v in model.dag.successors(u):
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    runs = contiguous(rng, n, stages)
    out = [0] * n
    for position, u in enumerate(order):
        out[u] = runs[position]
    return out


MODELS = ["gpt2", "t5", "bert", "cnn", "multi_io", "gpt2-bf16"]


@pytest.fixture(scope="module", params=MODELS)
def traced(request):
    """A model's graph and profile (``-bf16``: profiled for --bf16, its products' outputs
    held in bf16)."""
    name, _, precision = request.param.partition("-")
    example = load_example(spec(name))
    graph = trace(example)
    return graph, profile(graph, bf16=precision == "bf16")


@pytest.mark.parametrize("dp_shard, schedule", [(1, "1f1b"), (3, "1f1b"), (2, "zbv")])
def test_the_sums_equal_the_loops_to_the_last_bit(traced, dp_shard, schedule):
    graph, prof = traced
    model = CostModel(graph, prof, schedule=schedule, microbatches=4, dp_shard=dp_shard)
    rng = random.Random(dp_shard)
    n = model.num_units
    assignments = []
    for stages in (1, 2, 3, min(7, n)):
        assignments += [contiguous(rng, n, stages), monotone(model, rng, stages)]
        assignments.append([rng.randrange(stages) for _ in range(n)])  # any at all
    for recomputing in (model, model.assuming_recomputation()):
        for stage_of_unit in assignments:
            num_stages = max(stage_of_unit) + 1
            for trainable in (False, True):
                assert recomputing.stage_parameters(
                    stage_of_unit, num_stages, trainable
                ) == stage_parameters(recomputing, stage_of_unit, num_stages, trainable)
            assert recomputing.sums.optimizer_steps(
                recomputing.sums.assignment(stage_of_unit), num_stages
            ).tolist() == pytest.approx(optimizer_steps(recomputing, stage_of_unit, num_stages))
            assert recomputing.sums.tied_accumulations(
                recomputing.sums.assignment(stage_of_unit), num_stages
            ).tolist() == pytest.approx(tied_accumulations(recomputing, stage_of_unit, num_stages))
            assert recomputing._crossing(stage_of_unit, num_stages) == crossing(
                recomputing, stage_of_unit, num_stages
            )
            assert recomputing._counted_twice(stage_of_unit, num_stages) == counted_twice(
                recomputing, stage_of_unit, num_stages
            )
            assert recomputing._transients(stage_of_unit, num_stages) == transients(
                recomputing, stage_of_unit, num_stages
            )
            params = stage_parameters(recomputing, stage_of_unit, num_stages)
            trained = stage_parameters(recomputing, stage_of_unit, num_stages, True)
            if schedule == "1f1b":
                assert recomputing.gathered(stage_of_unit, params, trained) == gathered(
                    recomputing, stage_of_unit, params, trained
                )


def test_the_optimizer_step_costs_each_tensor_at_its_sizes_rate(traced):
    """With a calibrated step, each parameter's share of the step costs its bytes at the rate
    the spec measured for tensors of its size (here a launch-bound small tensor updates at a
    tenth of a large one's rate), each device's step its stages' (the slowest device's
    counts); without one, the bytes stream at the memory rate. Each gradient's scaling and
    norm before the step stream at the memory rate too, a launch per operator."""
    graph, prof = traced
    table = RateTable(((1024.0, 1e8), (1048576.0, 1e9)))
    timed = replace(prof, device=replace(prof.device, optimizer_steps={"adamw": table}))
    speed = prof.device.memory_bandwidth * prof.device.memory_efficiency
    for dp_shard in (1, 2):
        plain = CostModel(graph, prof, microbatches=4, dp_shard=dp_shard)
        model = CostModel(graph, timed, microbatches=4, dp_shard=dp_shard)
        for nbytes in (4096, 1 << 22):
            share = nbytes / dp_shard
            assert model.optimizer_step_time(nbytes) == pytest.approx(share / table.at(share))
            assert plain.optimizer_step_time(nbytes) == pytest.approx(
                share * OPTIMIZER_TRAFFIC["adamw"] / speed
            )
        # below the table's smallest tensor, a step costs that one's launches
        assert model.optimizer_step_time(64) == pytest.approx(1024 / 1e8)
        stage_of_unit = contiguous(random.Random(dp_shard), model.num_units, 2)
        steps = optimizer_steps(model, stage_of_unit, 2)
        assert model.evaluate(stage_of_unit, [0, 1]).optimizer_time == pytest.approx(max(steps))
        looped = CostModel(graph, timed, schedule="auto", microbatches=4, dp_shard=dp_shard)
        assert looped.evaluate(stage_of_unit, [0, 0]).optimizer_time == pytest.approx(sum(steps))
        # each gradient scaled (2 bytes moved per byte), then AdamW's 18 bytes per byte
        # streamed; squared (2) and summed (1) into the norm in its first stage alone (a tied
        # copy in a later stage is left out), each operator a launch
        launch, first = prof.device.kernel_overhead, first_stages(plain, stage_of_unit)
        streamed = [
            sum(
                launch
                + b / dp_shard * (2 + OPTIMIZER_TRAFFIC["adamw"]) / speed
                + (2 * launch + b / dp_shard * 3 / speed if first[n] == s else 0.0)
                for n, b in params.items()
            )
            for s, params in enumerate(trained_parameters(plain, stage_of_unit, 2))
        ]
        assert plain.evaluate(stage_of_unit, [0, 1]).optimizer_time == pytest.approx(max(streamed))


def test_a_bf16_gradient_is_normed_in_fp32():
    """Parameters held in bf16: the gradient is scaled in bf16 (2 bytes moved per byte), then
    cast to fp32 (1 read, 2 written) for the norm's square and sum (4 and 2 per bf16 byte)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).bfloat16()
    graph = trace(Example(model, (torch.randn(8, 64, dtype=torch.bfloat16),)))
    costs = CostModel(graph, profile(graph), microbatches=2)
    assert costs.dtype == torch.bfloat16
    device = costs.device
    speed, launch = device.memory_bandwidth * device.memory_efficiency, device.kernel_overhead
    assert costs.scale_time(4096) == pytest.approx(launch + 2 * 4096 / speed)
    assert costs.norm_time(4096) == pytest.approx(3 * launch + (3 + 4 + 2) * 4096 / speed)


@pytest.mark.parametrize("schedule, devices", [("1f1b", None), ("zbv", 2), ("auto", 2)])
def test_the_step_and_memory_alone_equal_the_prediction(traced, schedule, devices):
    """What partitioners read of many splits (the step and each device's peak; the peaks
    alone, with recomputation) equals the full prediction's."""
    graph, prof = traced
    model = CostModel(graph, prof, schedule=schedule, microbatches=4)
    rng = random.Random(schedule)
    for stages in (2, 4):
        if stages > model.num_units:
            continue
        stage_of_unit = monotone(model, rng, stages)
        placed = list(range(stages)) if devices is None else [0, 1, 1, 0][:stages]
        if schedule == "zbv" and stages != 4:
            continue
        prediction = model.evaluate(stage_of_unit, placed)
        assert model.step_and_memory(stage_of_unit, placed) == (
            prediction.step_time,
            prediction.device_memory,
        )
        recomputed = model.evaluate(stage_of_unit, placed, recompute=frozenset({0}))
        assert model.device_memory(stage_of_unit, placed, recompute=frozenset({0})) == list(
            recomputed.device_memory
        )
