"""Property test over random DAG-shaped models: compiled with every method and several stage
counts, the generated stages are equivalent to the model, or compilation fails with one of
autopipe's own errors. Never a wrong pipeline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

from autopipe.compiler import CompileOptions, compile_example
from autopipe.errors import AutopipeError
from autopipe.partitioning import METHODS
from autopipe.spec import Example
from autopipe.verify import verify

WIDTH = 8


class RandomDag(nn.Module):
    """Node i reads the sum of some earlier nodes (skips, fan-out) and applies its own Linear,
    a Linear shared with an earlier node (tied weights), an in-place ReLU, or adds in place
    into an earlier node that later nodes read (a write the pipeline must keep in order)."""

    def __init__(self, plan: list[tuple[str, tuple[int, ...], int]]):
        super().__init__()
        self.plan = plan
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in plan)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for i, (kind, sources, other) in enumerate(self.plan):
            h = sum(nodes[s] for s in sources)
            if kind == "tied":
                h = self.layers[other % (i + 1)](h)
            elif kind == "relu_":
                h = torch.relu_(self.layers[i](h))
            elif kind == "add_":
                target = nodes[other % len(nodes)]
                if target is not x:
                    target.add_(h)
                h = self.layers[i](h)
            else:
                h = self.layers[i](h)
            nodes.append(h)
        return self.out(nodes[-1]).sum() + nodes[len(nodes) // 2].mean()


@st.composite
def plans(draw) -> list[tuple[str, tuple[int, ...], int]]:
    size = draw(st.integers(3, 7))
    plan = []
    for i in range(size):
        sources = draw(st.sets(st.integers(0, i), min_size=1, max_size=3))
        kind = draw(st.sampled_from(["linear", "linear", "tied", "relu_", "add_"]))
        plan.append((kind, tuple(sorted(sources)), draw(st.integers(0, 10))))
    return plan


def _model(plan) -> RandomDag | None:
    """The model with its reference gradients, or None if PyTorch itself rejects it (an in-place
    write into a value autograd saved)."""
    torch.manual_seed(0)
    model = RandomDag(plan)
    x = torch.randn(4, WIDTH)
    try:
        model(x.clone()).backward()
    except RuntimeError:
        return None
    model.zero_grad(set_to_none=True)
    return model


@pytest.mark.slow
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=plans(), stages=st.integers(2, 4), devices=st.sampled_from([None, 2]))
# found by this test: a stage input that aliases an earlier stage's value, written in place
@example(
    plan=[("linear", (0,), 0), ("add_", (0,), 1), ("relu_", (0,), 0), ("add_", (0,), 1)],
    stages=2,
    devices=None,
)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_random_dag_models_compile_to_equivalent_pipelines(
    tmp_path_factory, method, plan, stages, devices
):
    model = _model(plan)
    assume(model is not None)
    devices = min(devices or stages, stages)
    out = tmp_path_factory.mktemp("dag") / "pipe"
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    options = CompileOptions(stages=stages, devices=devices, method=method)
    try:
        compile_example(Example(model, (x,)), out, options, report=False)
    except AutopipeError as exc:  # a catalogued refusal, e.g. more stages than units
        assert str(exc)
        return
    report = verify(out, Example(model, (x,)))
    assert report.ok, report.summary()
