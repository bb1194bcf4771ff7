"""Plans for bf16 mixed precision (``autopipe compile --bf16``): autopipe/profiling/precision.py,
the profile and cost model for it, and the package that runs it by default."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.compiler import CompileOptions, trace_step
from autopipe.ir.analysis import unit_workloads
from autopipe.partitioning.cost import CostModel, graph_facts
from autopipe.partitioning.handed_values import handed_values
from autopipe.profiling import device_spec, profile
from autopipe.profiling.precision import autocast_dtypes, cuda_policy
from autopipe.profiling.profile import Profile
from autopipe.runtime.core.pipeline import TrainingPlan
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, spec

PRODUCTS = ("aten.addmm.default", "aten.linear.default")


@pytest.fixture(scope="module")
def gpt2_graph():
    """The test zoo's GPT-2 (tanh GELU, tied head), traced."""
    example = load_example(spec("gpt2"))
    return example, trace_step(example, CompileOptions(stages=1))


def test_cuda_policy_casts_as_cuda_on_fake_tensors_only():
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    matrix, vector = torch.randn(4, 4), torch.randn(4)
    with FakeTensorMode() as fakes:
        fake, fake_matrix, fake_vector = (fakes.from_tensor(t) for t in (x, matrix, vector))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.pow(fake, 3).dtype == torch.bfloat16  # the CPU's policy
            assert torch.mv(fake_matrix, fake_vector).dtype == torch.float32
            with cuda_policy():
                assert torch.pow(fake, 3).dtype == torch.float32  # CUDA's: in fp32
                assert torch.exp(fake).dtype == torch.float32
                assert torch.softmax(fake, -1).dtype == torch.float32
                assert torch.mv(fake_matrix, fake_vector).dtype == torch.bfloat16
                assert torch.mm(fake, fake).dtype == torch.bfloat16  # the CPU's kernel kept
                assert torch.sum(fake).dtype == torch.float32
                # mixed inputs promoted (an fp32 buffer updated with a bf16 value)
                index = (torch.tensor([1]),)
                updated = fake_matrix.index_put(index, fake[:1].reshape(1, 4))
                assert updated.dtype == torch.float32
            assert torch.pow(fake, 3).dtype == torch.bfloat16  # removed on exit
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_policy():
        assert torch.pow(x, 3).dtype == torch.bfloat16  # real tensors: the CPU's policy


def test_autocast_dtypes_follow_the_policy(gpt2_graph):
    _, graph = gpt2_graph
    cpu = autocast_dtypes(graph, torch.device("cpu"))
    with cuda_policy():
        cuda = autocast_dtypes(graph, torch.device("cpu"))
    products = [n.name for n in graph.calls if n.target in PRODUCTS]
    assert products and all(cuda[name] == torch.bfloat16 for name in products)
    norms = [n.name for n in graph.calls if n.target == "aten.layer_norm.default"]
    assert norms and not any(name in cuda for name in norms)  # fp32, as traced
    powers = [n.name for n in graph.calls if n.target == "aten.pow.Tensor_Scalar"]
    assert powers and all(cpu[name] == torch.bfloat16 for name in powers)
    assert not any(name in cuda for name in powers)  # CUDA keeps the GELU's chain in fp32


def test_a_bf16_profile_saves_weight_copies_and_round_trips(gpt2_graph):
    _, graph = gpt2_graph
    h100 = device_spec("h100")
    fp32, bf16 = profile(graph, "analytic", h100), profile(graph, "analytic", h100, bf16=True)
    assert bf16.bf16 and not fp32.bf16 and bf16.source.endswith(", bf16 autocast")
    for unit, cost, plain in zip(graph.units, bf16.units, fp32.units):
        reads_products = any(graph[n].target in PRODUCTS for n in unit.nodes)
        # each weight a product reads, copied to bf16 and saved (its bias is not saved)
        assert (cost.cast_parameters > 0) == reads_products, unit.label
        assert cost.cast_parameters <= cost.parameters // 2
        assert plain.cast_parameters == 0
    mlp = [c for u, c in zip(graph.units, bf16.units) if "mlp.act" in u.label]
    plain_mlp = [c for u, c in zip(graph.units, fp32.units) if "mlp.act" in u.label]
    assert mlp and all(a.activations < b.activations for a, b in zip(mlp, plain_mlp))
    again = Profile.from_json(bf16.to_json())
    assert again.bf16 and [u.cast_parameters for u in again.units] == [
        u.cast_parameters for u in bf16.units
    ]
    assert "bf16" not in fp32.to_json() and not Profile.from_json(fp32.to_json()).bf16


def test_the_gpu_policy_keeps_more_than_the_cpus(gpt2_graph):
    """A GPU spec's profile saves the GELU's fp32 chain that the CPU's bf16 policy would not."""
    _, graph = gpt2_graph
    gpu = profile(graph, "analytic", device_spec("h100"), bf16=True)
    cpu = profile(graph, "analytic", replace(device_spec("h100"), device_type="cpu"), bf16=True)
    mlp = [i for i, u in enumerate(graph.units) if "mlp.act" in u.label]
    assert all(gpu.units[i].activations > cpu.units[i].activations for i in mlp)


def test_measured_and_analytic_agree_on_bf16_memory(gpt2_graph):
    """On this CPU, under its own autocast policy, the measured profile saves what the
    analytic one of a CPU's spec does, weight copies included."""
    example, graph = gpt2_graph
    cpu = replace(device_spec(), device_type="cpu")
    measured = profile(graph, "measured", cpu, example, bf16=True)
    analytic = profile(graph, "analytic", cpu, bf16=True)
    assert measured.bf16
    assert [u.activations for u in measured.units] == [u.activations for u in analytic.units]
    assert [u.cast_parameters for u in measured.units] == [
        u.cast_parameters for u in analytic.units
    ]
    with pytest.warns(UserWarning, match="autocast casts as on cpu"):  # measured for a GPU
        profile(graph, "measured", device_spec("h100"), example, bf16=True)


def test_fsdp2_gathers_bf16_and_saves_no_weight_copies(gpt2_graph):
    _, graph = gpt2_graph
    bf16 = profile(graph, "analytic", device_spec("h100"), bf16=True)
    fp32 = profile(graph, "analytic", device_spec("h100"))
    whole, sharded = CostModel(graph, bf16), CostModel(graph, bf16, dp_shard=2)
    assert whole.gather_scale == sharded.gather_scale == 0.5
    assert CostModel(graph, fp32, dp_shard=2).gather_scale == 1.0
    assert whole.activations == [u.activations for u in bf16.units]
    assert sharded.activations == [u.activations - u.cast_parameters for u in bf16.units]
    assert whole.compute_dtype == torch.bfloat16
    # FSDP2's gathers move (and its buffers hold) half the bytes of the fp32 model's
    stages, devices = [0] * len(graph.units), [0]
    params = sharded.stage_parameters(stages, 1)
    trained = sharded.stage_parameters(stages, 1, trainable=True)
    half = sharded.gathered(stages, params, trained)
    full = CostModel(graph, fp32, dp_shard=2).gathered(stages, params, trained)
    assert 0 < half[0] < full[0]
    gather = sharded.collective_time(sharded.gathered_bytes(params), devices)
    assert gather[0] < CostModel(graph, fp32, dp_shard=2).collective_time(params, devices)[0]


def test_a_package_planned_for_bf16_runs_it_by_default(tmp_path):
    compiled = compile_model("examples/gpt2.py:build", tmp_path / "pipe", 2, bf16=True, dp_shard=1)
    assert compiled.partition.settings.bf16 is True
    assert "bf16 autocast" in compiled.partition.profile_source
    package = load_pipeline(compiled.out)
    plan = package.PIPELINE["plan"]
    assert plan["bf16"] is True and plan["peak_flops"] == device_spec("h100").peak_flops(
        torch.bfloat16
    )
    options = importlib.import_module(f"{package.__name__}.runtime.options")
    pipeline = importlib.import_module(f"{package.__name__}.runtime.core.pipeline")
    described = pipeline.Pipeline.from_json(package.PIPELINE)
    assert options.parse_config([], described).bf16
    assert not options.parse_config(["--no-bf16"], described).bf16
    assert TrainingPlan.from_json(plan, "plan").bf16
    unplanned = {k: v for k, v in plan.items() if k != "bf16"}
    assert not TrainingPlan.from_json(unplanned, "plan").bf16  # packages from before it
    assert TrainingPlan.from_json(unplanned, "plan").to_json() == unplanned
    with pytest.raises(Exception, match="bf16"):
        TrainingPlan.from_json(plan | {"bf16": "yes"}, "plan")


def test_a_bf16_profile_times_its_weight_casts(gpt2_graph):
    """The analytic profile times autocast's copies of the parameters as the roofline times any
    copy (each read in fp32, written in bf16, one launch); the measured one times them on this
    CPU; units that cast nothing cost nothing."""
    example, graph = gpt2_graph
    h100 = device_spec("h100")
    bf16, fp32 = profile(graph, "analytic", h100, bf16=True), profile(graph, "analytic", h100)
    assert all(u.cast_time == 0 for u in fp32.units)
    for unit, work, cost in zip(graph.units, unit_workloads(graph), bf16.units):
        if not cost.cast_parameters:
            assert cost.cast_time == 0, unit.label
            continue
        params = {graph.param_of(graph[n].target).names[0] for n in work.state}
        numels = [graph.params[name].nbytes // 4 for name in params]
        expected = sum(6 * n / h100.memory_rate(6 * n) + h100.kernel_overhead for n in numels)
        assert cost.cast_time == pytest.approx(expected), unit.label
        assert 0 < cost.cast_time < cost.forward
    again = Profile.from_json(bf16.to_json())
    assert [u.cast_time for u in again.units] == [u.cast_time for u in bf16.units]
    assert "cast_time" not in fp32.to_json()["units"][0]
    cpu = replace(device_spec(), device_type="cpu")
    measured = profile(graph, "measured", cpu, example, bf16=True)
    for cost, timed in zip(bf16.units, measured.units):
        assert (timed.cast_time > 0) == (cost.cast_time > 0)
        assert timed.cast_time <= timed.forward


def test_fsdp2_takes_the_weight_casts_off_the_stages_forwards(gpt2_graph):
    """With --dp-shard under --bf16, FSDP2 gathers bf16 weights: a stage's forward casts none
    (as the next test shows on FSDP2 itself), its backward still casts the gradients."""
    _, graph = gpt2_graph
    bf16 = profile(graph, "analytic", device_spec("h100"), bf16=True)
    whole, sharded = CostModel(graph, bf16), CostModel(graph, bf16, dp_shard=2)
    assert any(u.cast_time for u in bf16.units)
    assert whole.forward == [u.forward for u in bf16.units]
    assert sharded.forward == pytest.approx([u.forward - u.cast_time for u in bf16.units])
    # (the cost model adds the gradients into the step's; FSDP2 adds the reduced shards)
    assert [b - a for b, a in zip(whole.backward, whole.accumulation)] == pytest.approx(
        [u.backward for u in bf16.units]
    )
    assert sharded.backward == [u.backward for u in bf16.units]
    # the whole model's profile: no casts to take off
    fp32 = profile(graph, "analytic", device_spec("h100"))
    assert CostModel(graph, fp32, dp_shard=2).forward == [u.forward for u in fp32.units]


def test_a_stage_holds_the_values_autocast_makes_in_their_dtype(gpt2_graph):
    """A bf16 profile records which values autocast makes in bf16 (a product's output); the
    cost model holds those at half their traced bytes (the locals handed between units, a
    value several units save) and still sends them in the traced dtype."""
    _, graph = gpt2_graph
    h100 = device_spec("h100")
    bf16, fp32 = profile(graph, "analytic", h100, bf16=True), profile(graph, "analytic", h100)
    with cuda_policy():
        assert bf16.autocast_dtypes == autocast_dtypes(graph, torch.device("cpu"))
    assert bf16.autocast_dtypes and set(bf16.autocast_dtypes.values()) == {torch.bfloat16}
    assert Profile.from_json(bf16.to_json()).autocast_dtypes == bf16.autocast_dtypes
    assert not fp32.autocast_dtypes and "autocast_dtypes" not in fp32.to_json()
    model = CostModel(graph, bf16)
    for exchange, held in zip(model.exchanges, model.held_bytes):
        half = exchange.name in bf16.autocast_dtypes
        assert held == (exchange.activation / 2 if half else exchange.activation), exchange.name
    # the locals: the same values as the traced bytes would give, the bf16 ones at half
    traced = handed_values(
        [(e.name, e.producer, e.readers, e.activation) for e in model.exchanges],
        [
            [
                u
                for u in (e.producer, *e.readers)
                if 0 <= u < model.num_units and e.name in model.saved_values[u]
            ]
            for e in model.exchanges
        ],
        graph_facts(graph).storage_of,
        [block.units for block in model.blocks.values()],
        model.num_units,
    )
    assert len(traced) == len(model.handed)
    ratios = {held.nbytes / plain.nbytes for held, plain in zip(model.handed, traced)}
    assert ratios == {0.5, 1.0}
    # what crosses a boundary: the traced dtype's bytes
    fp32_model = CostModel(graph, fp32)
    stages = [0] * (len(graph.units) // 2) + [1] * (len(graph.units) - len(graph.units) // 2)
    assert model._crossing(stages, 2) == fp32_model._crossing(stages, 2)


class _Casts(TorchDispatchMode):
    """The dtypes and shapes of the tensors ``aten._to_copy`` copies inside it."""

    def __init__(self):
        super().__init__()
        self.copied: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.copied.append((args[0].dtype, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sharded", [False, True])
def test_fsdp2_in_bf16_casts_no_weight_in_the_forward(single_process_group, sharded):
    """What the cost model takes off a sharded bf16 stage, on torch's FSDP2 itself: under
    autocast a stage's forward copies each weight to bf16 (the profile's ``cast_time``); under
    FSDP2's bf16 policy, as train.py --bf16 --dp-shard shards it, it copies none (FSDP2 casts
    flat shards as it gathers them), while its backward still casts the gradients to fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    if sharded:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    forward, backward = _Casts(), _Casts()
    with torch.autocast("cpu", dtype=torch.bfloat16), forward:
        out = model(torch.randn(4, 16))
    with backward:
        out.float().sum().backward()
    cast = {shape for dtype, shape in forward.copied if dtype == torch.float32} & weights
    assert cast == (set() if sharded else weights)
    if sharded:  # FSDP2 reduces fp32 gradients: it casts them, in one copy of all
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    else:  # autocast's casts, backward: each weight's gradient to fp32
        assert weights <= {shape for dtype, shape in backward.copied if dtype == torch.bfloat16}
