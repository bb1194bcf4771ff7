"""Calibrated device specs (autopipe/profiling/devices.py RateTable, calibrate.py): tables
round-trip, interpolate monotonically between their points, and the analytic profile reads
them; a spec without tables profiles as before."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autopipe.compiler import CompileOptions, trace_step
from autopipe.errors import AutopipeError
from autopipe.profiling import device_spec, profile
from autopipe.profiling.devices import DeviceSpec, RateTable
from autopipe.profiling.calibrate import known_gpu
from autopipe.profiling.operator_rates import operator_tables
from autopipe.spec import Example

H100 = device_spec("h100")


def test_a_table_interpolates_between_its_points_and_holds_its_ends():
    table = RateTable(((1e3, 1e9), (1e6, 4e10), (1e9, 9e10)))
    assert table.at(1.0) == 1e9 and table.at(1e12) == 9e10  # the ends
    assert table.at(1e6) == pytest.approx(4e10)
    # log-log: halfway in log size between 1e3 and 1e6 is the geometric mean of the rates
    assert table.at(10**4.5) == pytest.approx(math.sqrt(1e9 * 4e10))
    sizes = [10 ** (k / 10) for k in range(20, 100)]
    rates = [table.at(size) for size in sizes]
    assert all(b >= a for a, b in zip(rates, rates[1:]))  # monotone where the points are
    falling = RateTable(((1.0, 5.0), (10.0, 2.0)))
    values = [falling.at(1 + k / 10) for k in range(91)]
    assert all(2.0 <= v <= 5.0 for v in values) and all(b <= a for a, b in zip(values, values[1:]))


def test_a_calibrated_spec_round_trips_and_bad_tables_are_refused():
    tables = {
        "matmul.float32": RateTable(((1e6, 5e10), (1e9, 1e11))),
        "causal_attention.float32": RateTable(((1e7, 3e10),)),
        "memory": RateTable(((1e4, 1e10), (1e8, 3e10))),
    }
    spec = DeviceSpec.from_json(H100.to_json() | {"name": "measured"})
    calibrated = DeviceSpec(**{**spec.__dict__, "tables": tables, "view_overhead": 1e-6})
    assert calibrated.calibrated and not H100.calibrated
    data = calibrated.to_json()
    assert data["tables"]["memory"] == [[1e4, 1e10], [1e8, 3e10]]
    assert DeviceSpec.from_json(data) == calibrated
    assert "tables" not in H100.to_json()  # a spec without tables writes none
    with pytest.raises(AutopipeError, match="sizes must ascend"):
        DeviceSpec.from_json(data | {"tables": {"memory": [[2.0, 1.0], [1.0, 1.0]]}})
    with pytest.raises(AutopipeError, match="not a kind of table"):
        DeviceSpec.from_json(data | {"tables": {"gemm.float32": [[1.0, 1.0]]}})
    with pytest.raises(AutopipeError, match=r"list of \[size, rate\] pairs"):
        DeviceSpec.from_json(data | {"tables": {"memory": [[1.0, -1.0]]}})


def test_the_rates_come_from_the_tables_else_the_peaks():
    calibrated = DeviceSpec(
        **{**H100.__dict__, "tables": {"matmul.bfloat16": RateTable(((1e6, 1e12), (1e12, 5e14)))}}
    )
    assert calibrated.compute_rate("matmul", torch.bfloat16, 1e12) == 5e14
    # no table for this kind or dtype: the peak times the efficiency, as an uncalibrated spec
    peak = H100.peak_flops(torch.float32) * H100.compute_efficiency
    assert calibrated.compute_rate("matmul", torch.float32, 1e12) == peak
    assert calibrated.compute_rate(None, torch.bfloat16, 1e12) == H100.compute_rate(
        None, torch.bfloat16, 1e12
    )
    assert calibrated.memory_rate(1e6) == H100.memory_bandwidth * H100.memory_efficiency


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.a(x).sum()


def test_the_analytic_profile_times_products_by_the_table():
    """One 64 x 256 x 256 product forward (and two backward): a calibrated spec whose matmul
    rate is 1e9 FLOP/s at every size times them at that rate; without tables the spec's peak
    and efficiency time them, as before."""
    graph = trace_step(Example(_Linear(), (torch.randn(64, 256),), {}), CompileOptions(stages=1))
    slow = DeviceSpec(
        **{
            **H100.__dict__,
            "tables": {"matmul.float32": RateTable(((1.0, 1e9),))},
            "kernel_overhead": 0.0,
        }
    )
    plain = DeviceSpec(**{**H100.__dict__, "kernel_overhead": 0.0})
    timed = profile(graph, "analytic", slow).units
    before = profile(graph, "analytic", plain).units
    product = 2 * 64 * 256 * 256
    forward = sum(u.forward for u in timed)
    assert forward >= product / 1e9 and forward == pytest.approx(product / 1e9, rel=0.05)
    assert sum(u.backward for u in timed) >= product / 1e9  # the weight's gradient at least
    peak = H100.peak_flops(torch.float32) * H100.compute_efficiency
    bandwidth = H100.memory_bandwidth * H100.memory_efficiency
    moved = 4 * (64 * 256 + 256 * 256 + 64 * 256)
    assert sum(u.forward for u in before) >= max(product / peak, moved / bandwidth)
    assert sum(u.forward for u in before) < forward / 100


class _Gelu(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh").sum()


def test_an_operator_with_its_own_table_is_timed_by_it():
    """A CPU's tanh GELU is bound by its arithmetic, not by memory: a spec with a measured
    ``op.gelu.float32`` table times it by that (here 1e6 elements/s: 4096 elements take 4.1
    ms), where the roofline alone would stream its bytes in microseconds."""
    graph = trace_step(Example(_Gelu(), (torch.randn(64, 64),), {}), CompileOptions(stages=1))
    table = {"op.gelu.float32": RateTable(((1.0, 1e6), (1e8, 1e6)))}
    measured = DeviceSpec(**{**H100.__dict__, "tables": table, "view_overhead": 0.0})
    forward = sum(u.forward for u in profile(graph, "analytic", measured).units)
    plain = sum(u.forward for u in profile(graph, "analytic", H100).units)
    assert forward >= 4096 / 1e6 and forward == pytest.approx(4096 / 1e6, rel=0.05)
    assert plain < forward / 50


def test_a_rate_measured_only_on_tiny_calls_is_not_extrapolated():
    """A loss's gradient seed (``ones_like`` of one element, 15 us) is the only ``ones_like``
    the calibration's layers call: its rate of 65k elements/s would time a 128k-element call
    at 2 s. A table that stops short of the sizes where rates stop growing is read within its
    range and left to the roofline beyond it; one that reaches them extrapolates."""
    tables = {
        "op.ones_like.float32": RateTable(((1.0, 65536.0),)),
        "op.gelu.float32": RateTable(((1e5, 1e9), (1e6, 1e9))),
    }
    spec = DeviceSpec(**{**H100.__dict__, "tables": tables})
    assert spec.operator_time("ones_like", torch.float32, 1.0, None) == pytest.approx(1 / 65536)
    assert spec.operator_time("ones_like", torch.float32, 131072.0, None) is None
    assert spec.operator_time("gelu", torch.float32, 1e7, None) == pytest.approx(1e7 / 1e9)


def test_the_cpus_operators_are_measured_in_real_layers():
    """``autopipe calibrate`` on a CPU times the operators of a GPT-2-style, a Llama-style and
    a convolution block forward and backward: FLOPs/s for products and convolutions,
    elements/s for the rest, each by size, and they read back as a spec."""
    torch.set_num_threads(1)
    tables = operator_tables(log=lambda message: None)
    for name in ("gelu", "native_layer_norm", "bernoulli_", "_softmax", "native_batch_norm"):
        assert f"op.{name}.float32" in tables, name
    convolution = tables["op.convolution.float32"]
    assert len(convolution.points) == 3 and convolution.points[0][0] > 1e7  # FLOPs
    gelu = tables["op.gelu.float32"]
    assert gelu.points[0][0] == 128 * 4 * 256  # the elements of the smallest layer's MLP
    spec = DeviceSpec(**{**H100.__dict__, "tables": tables})
    assert DeviceSpec.from_json(spec.to_json()) == spec


def test_a_gpu_is_known_by_its_name():
    """A calibrated GPU takes the links of the nodes it is built into from the device of the
    table its name is: one GPU cannot measure NVLink or the NICs."""
    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"]
    assert [known_gpu(n).name for n in names] == ["H200", "H100", "H100-PCIe", "A100"]
    assert known_gpu("Some Accelerator") is None
