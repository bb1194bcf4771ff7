"""Profilers: FLOP and memory counts on fake tensors, timings on the local device."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from autopipe.cli import main as autopipe_main
from autopipe.compiler import CompileOptions, trace_step
from autopipe.errors import AutopipeError
from autopipe.profiling import calibrate, device_spec, devices, measured, profile
from autopipe.profiling.devices import DeviceSpec, RateTable
from autopipe.profiling.measured import profile_measured
from autopipe.spec import Example, load_example

from conftest import spec


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def linear_graph(on_meta=False):
    if on_meta:
        with torch.device("meta"):
            model = TwoLinear()
    else:
        model = TwoLinear()
    example = Example(model, (torch.randn(16, 64),))
    return example, trace_step(example, CompileOptions(stages=1))


def test_analytic_flops_follow_flop_counter():
    _, graph = linear_graph()
    prof = profile(graph, "analytic", device_spec("a100"))
    by_label = {u.label: c for u, c in zip(graph.units, prof.units)}
    a, b = by_label["a (Linear)"], by_label["b (Linear)"]
    assert a.flops_forward == 2 * 16 * 64 * 128  # two FLOPs per multiply-add
    assert b.flops_forward == 2 * 16 * 128 * 32
    # backward: grad of the input and of the weight (the first layer's input needs no grad)
    assert b.flops_backward == 2 * b.flops_forward
    assert a.flops_backward == a.flops_forward
    assert all(c.forward > 0 and c.backward >= 0 for c in prof.units)
    # bytes read and written: at least the weight, the input and the output of a linear layer
    assert a.bytes_forward >= (64 * 128 + 128 + 16 * 64 + 16 * 128) * 4
    assert a.parameters == (64 * 128 + 128) * 4 and b.parameters == (128 * 32 + 32) * 4


def test_analytic_memory_counts_saved_activations():
    _, graph = linear_graph()
    prof = profile(graph, "analytic")
    by_label = {u.label: c for u, c in zip(graph.units, prof.units)}
    assert by_label["a (Linear)"].activations == 16 * 64 * 4  # its input x
    assert by_label["<relu>"].activations == 16 * 128 * 4  # relu saves its output
    assert by_label["b (Linear)"].outputs == 16 * 32 * 4


def test_analytic_needs_no_weights():
    _, real = linear_graph()
    _, meta = linear_graph(on_meta=True)
    assert profile(real, "analytic").units == profile(meta, "analytic").units


def test_roofline_uses_device_spec():
    _, graph = linear_graph()
    slow = DeviceSpec("slow", {"default": 1e9}, 1e9, 1e9, 1e9, kernel_overhead=0.0)
    fast = DeviceSpec("fast", {"default": 1e12}, 1e12, 1e9, 1e9, kernel_overhead=0.0)
    assert sum(u.time for u in profile(graph, "analytic", slow).units) == pytest.approx(
        1000 * sum(u.time for u in profile(graph, "analytic", fast).units)
    )


def test_measured_profile_times_every_unit():
    example = load_example(spec("cnn"))
    graph = trace_step(example, CompileOptions(stages=1))
    prof = profile(graph, "measured", device_spec(), example)
    assert prof.mode == "measured" and prof.measured_on.startswith("cpu (")
    assert prof.source.startswith("measured on cpu (") and "memory and link of H100" in prof.source
    assert len(prof.units) == len(graph.units)
    assert all(u.forward > 0 for u in prof.units)
    conv = next(c for u, c in zip(graph.units, prof.units) if "Conv2d" in u.label)
    assert conv.backward > 0 and conv.activations > 0


def test_measured_profile_runs_like_a_rank_and_interleaves_rounds(monkeypatch):
    """Units are timed with one intra-op thread (what torchrun gives a CPU rank; the caller's
    setting is restored), round by round: every unit once per round, the median kept."""
    example = load_example(spec("mlp"))
    graph = trace_step(example, CompileOptions(stages=1))
    calls = []
    run = measured._run

    def recording(graph, work, values, device, timed, *precision):
        calls.append((work.nodes[0].unit, timed, torch.get_num_threads()))
        return run(graph, work, values, device, timed, *precision)

    monkeypatch.setattr(measured, "_run", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prof = measured.profile_measured(graph, device_spec(), example, warmup=1, repeats=3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {threads for _, _, threads in calls} == {1} and "1 thread)" in prof.measured_on
    forward = [unit for unit, timed, _ in calls if timed == "forward"]
    units = len(graph.units)
    assert forward == list(range(units)) * 4  # the warm-up round, then 3 rounds


def test_measured_and_analytic_agree_on_memory():
    """On this CPU, the analytic profile of a CPU's spec (its attention kernels: a GPU's keep
    other tensors for the backward) saves what the measured one does."""
    example = load_example(spec("gpt2"))
    graph = trace_step(example, CompileOptions(stages=1))
    cpu = replace(device_spec(), device_type="cpu")
    measured = profile(graph, "measured", cpu, example)
    analytic = profile(graph, "analytic", cpu)
    assert [u.activations for u in measured.units] == [u.activations for u in analytic.units]


def test_device_specs():
    assert device_spec("H100").memory == 80 * 1024**3
    assert device_spec("a100").peak_flops(torch.bfloat16) == 312e12
    with pytest.raises(AutopipeError, match="unknown device 'tpu'.*H100"):
        device_spec("tpu")


def test_device_spec_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        '{"name": "mine", "flops": {"default": 1e13}, "memory_bandwidth": 1e11, "memory": 1e10, "link_bandwidth": 1e9}'
    )
    assert device_spec(str(path)).name == "mine"
    path.write_text('{"name": "mine"}')
    with pytest.raises(
        AutopipeError, match="missing flops, link_bandwidth, memory, memory_bandwidth"
    ):
        device_spec(str(path))


def test_a_committed_calibrated_spec_replaces_the_datasheet_one(tmp_path):
    """A calibrated H200 committed as ``specs/h200.json`` (``calibrate``'s spec, named after
    the GPU as CUDA names it) is the table's H200 under the table's name; the other devices keep
    their datasheet figures; a file named after no device of the table, or holding no measured
    tables, is refused naming the file."""
    datasheet = devices.DATASHEET_DEVICES["h200"]
    calibrated = replace(
        datasheet,
        name="NVIDIA H200",
        flops={"float32": 4.5e13, "bfloat16": 7.5e14, "default": 4.5e13},  # as measured
        memory=139 * 2**30,
        compute_efficiency=1.0,
        tables={"matmul.bfloat16": RateTable(((1e9, 3e14), (1e12, 7.5e14)))},
    )
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "h200.json").write_text(json.dumps(calibrated.to_json()))
    known = devices.known_devices(folder)
    h200 = replace(calibrated, name="H200", datasheet_flops=datasheet.flops)
    assert known["h200"] == h200 and known["h200"].calibrated
    # the cost model reads the measured rates; MFU stays against the datasheet's peak
    assert known["h200"].peak_flops(torch.bfloat16) == 7.5e14
    assert known["h200"].utilisation_peak(torch.bfloat16) == datasheet.peak_flops(torch.bfloat16)
    assert datasheet.utilisation_peak(torch.bfloat16) == datasheet.peak_flops(torch.bfloat16)
    assert devices.DeviceSpec.from_json(h200.to_json()) == h200  # round trip
    assert known["h100"] is devices.DATASHEET_DEVICES["h100"]
    assert not any(spec.calibrated for spec in devices.known_devices(tmp_path).values())
    (folder / "h300.json").write_text(json.dumps(calibrated.to_json()))
    with pytest.raises(AutopipeError, match=r"h300\.json: 'h300' is not a device of the table"):
        devices.known_devices(folder)
    (folder / "h300.json").unlink()
    (folder / "h200.json").write_text(json.dumps(datasheet.to_json()))
    with pytest.raises(AutopipeError, match=r"h200\.json holds no measured tables"):
        devices.known_devices(folder)
    # what autopipe ships: each committed spec is its device's, calibrated
    for path in devices.CALIBRATED_SPECS.glob("*.json"):
        assert devices.KNOWN_DEVICES[path.stem].calibrated


@pytest.mark.slow
def test_calibrate_writes_a_usable_spec(tmp_path):
    threads = torch.get_num_threads()
    arguments = ["calibrate", "--device", "cpu", "--name", "here", "-o", str(tmp_path / "cpu.json")]
    assert autopipe_main(arguments) == 0
    assert torch.get_num_threads() == threads  # measured with one, the caller's back after
    spec = device_spec(str(tmp_path / "cpu.json"))
    assert spec.name == "here" and spec.compute_efficiency == 1.0
    assert spec.flops["float32"] > 1e8 and spec.memory_bandwidth > 1e8 and spec.link_bandwidth > 1e6
    assert 0 < spec.kernel_overhead < 1e-3 and spec.memory > 1 << 30
    # the rates by size the analytic profile interpolates
    assert spec.calibrated and 0 < spec.view_overhead < 1e-3
    # a receive while its sender computes, on this CPU's two ranks: the handshake's wait
    assert spec.link_latency <= spec.receive_overhead < 0.1
    # AdamW's step streams its state in several passes (SGD's in one) and launches its
    # operators for every tensor on a CPU: small tensors update slower than large ones
    adamw, sgd = spec.optimizer_steps["adamw"], spec.optimizer_steps["sgd"]
    assert len(adamw.points) == 5 and adamw.at(1024) < adamw.at(1 << 22)
    assert all(a < s for (_, a), (_, s) in zip(adamw.points, sgd.points))
    kinds = {"matmul", "attention", "causal_attention", "attention_backward"}
    assert {f"{kind}.float32" for kind in kinds} | {"memory"} <= set(spec.tables)
    assert len(spec.tables["matmul.float32"].points) >= 4
    # gloo's collectives between the two ranks, by the bytes a rank sends
    assert set(spec.collectives) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(len(table.points) == 5 for table in spec.collectives.values())
    _, graph = linear_graph()
    assert sum(u.time for u in profile(graph, "analytic", spec).units) > 0


def test_a_spec_file_with_optimizer_steps_and_collectives_reads_strictly(tmp_path):
    """A calibrated spec's optimizer steps and collectives (rates by size) round-trip; a step
    of another optimizer, a collective no plan costs, or one that is no table, is refused
    naming it."""
    spec = replace(
        device_spec("H100"),
        optimizer_steps={
            "adamw": RateTable(((1024.0, 1e8), (1e6, 2e9))),
            "sgd": RateTable(((1024.0, 5e8),)),
        },
        collectives={"all_reduce": RateTable(((16384.0, 2e8), (1.6e7, 1.5e9)))},
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_json()))
    assert device_spec(str(path)) == spec
    written = device_spec("H100").to_json()  # none measured: none written
    assert "optimizer_steps" not in written and "collectives" not in written
    for field, bad, message in (
        ("optimizer_steps", {"lamb": [[1024.0, 1e8]]}, "steps by optimizer"),
        ("optimizer_steps", {"adamw": {"per_byte": 1e-12}}, r"optimizer_steps\['adamw'\] must be"),
        ("collectives", {"broadcast": [[1024.0, 1e8]]}, "rates by collective"),
        ("collectives", {"all_gather": [[1024.0, -1.0]]}, r"collectives\['all_gather'\] must be"),
    ):
        path.write_text(json.dumps(spec.to_json() | {field: bad}))
        with pytest.raises(AutopipeError, match=message):
            device_spec(str(path))


class DroppedAttention(nn.Module):
    """Self-attention that drops some of its attention out in training (GPT-2's, BERT's)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return out.transpose(1, 2).reshape(x.shape).sum()


def test_a_gpus_profile_keeps_what_its_fused_attention_keeps(tmp_path):
    """On a GPU's spec, attention that drops some of its attention out costs the fused kernel
    a GPU runs, which keeps one log-sum-exp per row for the backward; a CPU's spec (its kernels:
    the math path, for dropout) keeps the probabilities, heads x sequence x sequence, and the
    dropout's mask. The spec says which (``device_type``), round-trips it and refuses others."""
    example = Example(DroppedAttention(), (torch.randn(2, 256, 64),))
    graph = trace_step(example, CompileOptions(stages=1))
    gpu = device_spec("H100")
    cpu = replace(gpu, device_type="cpu")
    on_gpu, on_cpu = (
        sum(u.activations for u in profile(graph, "analytic", s).units) for s in (gpu, cpu)
    )
    probabilities = 2 * 4 * 256 * 256 * 4  # float32, per sample and head
    assert on_cpu - on_gpu >= probabilities, (on_cpu, on_gpu)
    assert on_gpu < probabilities / 2
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(cpu.to_json()))
    assert device_spec(str(path)) == cpu
    path.write_text(json.dumps(cpu.to_json() | {"device_type": "tpu"}))
    with pytest.raises(AutopipeError, match='device_type must be "cuda"'):
        device_spec(str(path))


def test_calibrate_refuses_fewer_than_one_thread(tmp_path, capsys):
    """``--threads`` (default 1, what torchrun gives each of several ranks): none is refused
    before anything is measured or written."""
    out = tmp_path / "cpu.json"
    assert autopipe_main(["calibrate", "--device", "cpu", "--threads", "0", "-o", str(out)]) != 0
    assert "1 thread or more, not 0" in capsys.readouterr().err and not out.exists()


def test_a_measured_profile_is_reported_as_measured_on_this_machine(tmp_path):
    """Not "for H100": the partition, the compile summary and the report name the machine the
    times were measured on, and the spec only for memory and links."""
    from conftest import compile_model

    result = compile_model("mlp", tmp_path / "pipe", 2, profile="measured", report=True)
    assert result.partition.settings.measured_on.startswith("cpu (")
    source = result.partition.profile_source
    assert source.startswith("measured on cpu (") and source.endswith("memory and link of H100")
    assert source in (tmp_path / "pipe" / "report" / "report.html").read_text()


class Attention(nn.Module):
    """Attention through ``scaled_dot_product_attention`` (the CPU's flash kernel when profiled
    on fake CPU tensors), and code asking a tensor for its device."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out + torch.zeros(1, device=x.device)


def test_analytic_attention_is_counted_as_torch_counts_a_gpu_kernel():
    """The CPU's flash attention kernel gets the FLOPs torch's counter gives the GPU's (it
    leaves the CPU's at zero): 2 x 2 matrix products of 32 x 16 x 32 per head, forward; the
    backward recomputes the scores and takes four more."""
    example = Example(Attention(), (torch.randn(2, 32, 64),))
    graph = trace_step(example, CompileOptions(stages=1))
    prof = profile(graph, "analytic", device_spec("h100"))
    heads = 2 * 4
    products = 2 * heads * 32 * 16 * 32  # FLOPs of one attention matrix product, every head
    linear = 2 * 64 * 64 * 192
    assert sum(u.flops_forward for u in prof.units) == 2 * products + linear
    assert sum(u.flops_backward for u in prof.units) == 5 * products + linear  # no input grad


def test_analytic_times_launch_no_kernel_for_metadata_nor_the_profilers_own_work():
    """Asking a tensor for its device, and the gradient the profiler seeds a unit's backward
    with, cost nothing: a unit's time is its operators' (on a device without launch overhead,
    their bytes over the bandwidth: forward a product and a relu, backward the relu's and the
    weight's gradient)."""
    spec = DeviceSpec(
        "bytes", {"default": 1e12}, 1e9, 1e9, 1e9, memory_efficiency=1.0, kernel_overhead=0.0
    )

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(256, 256))

        def forward(self, x):
            return torch.relu(x * self.w).to(x.device)

    graph = trace_step(Example(Scaled(), (torch.randn(256, 256),)), CompileOptions(stages=1))
    seconds = 256 * 256 * 4 / 1e9  # one pass over a tensor
    forward = backward = 0.0
    for unit in profile(graph, "analytic", spec).units:
        forward, backward = forward + unit.forward, backward + unit.backward
    assert forward == pytest.approx(5 * seconds)  # mul: 2 in, 1 out; relu: 1 in, 1 out
    assert backward == pytest.approx(6 * seconds)  # threshold_backward and grad x w: 3 each


@pytest.mark.slow
def test_the_local_cpu_is_calibrated_once_and_cached(tmp_path, monkeypatch, capsys):
    """``--device-spec cpu`` (issue 42): this machine's CPU, measured with one thread on first
    use, kept in autopipe's cache, read from it afterwards (no second measurement), and named so
    that train.py compares a run on the CPU with its plan."""
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    # the measurements themselves: test_calibrate_writes_a_usable_spec (half a minute)
    rates = device_spec("h100")
    monkeypatch.setattr(
        calibrate, "_calibrate", lambda device, name, log: replace(rates, name=name)
    )
    local = calibrate.resolve_device_spec("cpu", log=print)
    (cached,) = (tmp_path / "cache" / "devices").glob("cpu_*.json")
    assert f"calibrating this machine's cpu (first use; the spec is kept in {cached})" in (
        capsys.readouterr().out
    )
    assert local.name.startswith("cpu (") and local.name.endswith(", 1 thread)")
    assert local.flops["float32"] > 1e8 and local.link_bandwidth > 1e6

    monkeypatch.setattr(calibrate, "_CALIBRATED", {})  # a new process: the file, not memory
    measured = []
    monkeypatch.setattr(calibrate, "calibrate", lambda *args, **kwargs: measured.append(args))
    assert calibrate.resolve_device_spec(" CPU ", log=print) == local and not measured
    assert "calibrating" not in capsys.readouterr().out
    out = tmp_path / "pipe"
    assert autopipe_main(["compile", spec("mlp"), "--stages", "2", "--out", str(out),
                 "--device-spec", "cpu", "--no-report"]) == 0  # fmt: skip
    assert f"analytic profile for {local.name}" in capsys.readouterr().out and not measured


def test_the_local_gpu_needs_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AutopipeError, match="torch sees no CUDA device here; run `autopipe"):
        calibrate.resolve_device_spec("cuda")


def test_units_timed_in_the_step_split_one_forward_and_backward(monkeypatch):
    """Timed in the step (a GPU's default, here on the CPU with a clock that ticks once per
    reading), each unit's forward is the one tick between its two marks, and the units'
    backward times share out the whole backward between the first gradient hook and its end,
    in the order the hooks fire; FLOPs and memory do not depend on how time was taken. (The
    speed this buys on a GPU is measured by benchmarks/gpu.py, not asserted here.)"""
    example = load_example(spec("gpt2"))
    graph = trace_step(example, CompileOptions(stages=1))
    h100 = device_spec("h100")
    alone = profile_measured(graph, h100, example, in_step=False, repeats=1, warmup=0)
    ticks = iter(range(10**9))
    monkeypatch.setattr(measured.time, "perf_counter", lambda: float(next(ticks)))
    in_step = profile_measured(graph, h100, example, in_step=True, repeats=1, warmup=0)
    assert [u.forward for u in in_step.units] == [1.0] * len(graph.units)
    backward = [u.backward for u in in_step.units]
    assert all(b >= 0 for b in backward) and sum(backward) > 0
    assert all(float(b).is_integer() for b in backward)  # whole ticks between marks
    assert [u.activations for u in in_step.units] == [u.activations for u in alone.units]
    assert [u.flops_backward for u in in_step.units] == [u.flops_backward for u in alone.units]
