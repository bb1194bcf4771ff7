"""Property test over random DAG-shaped models: compiled with every method and several stage
counts, the generated stages are equivalent to the model, or compilation fails with one of
autopipe's own errors. Never a wrong pipeline."""

from __future__ import annotations

import dataclasses
import ast
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

from autopipe.compiler import (
    CompileOptions,
    compile_example,
    compile_spec,
    generate_step,
    load_graph,
)
from autopipe.errors import AutopipeError
from autopipe.partitioning import METHODS, Partition
from autopipe.profiling.profile import graph_digest
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


# -- corrupted artefacts ----------------------------------------------------------------------
INJECTIONS = [
    "__import__('os').system('touch PWNED')",
    "x\nimport os",
    'x"""',
    "x; y",
    "self",
    "1abc",
    "a.b",
    "../x",
    "aten.linear.default(x)",
]
WRONG_VALUES = [None, True, False, -1, 10**9, 1.5, "", [], {}, [INJECTIONS[0]], {"ref": "x"}]


@pytest.fixture(scope="module")
def mlp_artifacts(tmp_path_factory) -> Path:
    """The artefacts folder of the 2-stage MLP, compiled once."""
    from conftest import ROOT

    out = tmp_path_factory.mktemp("mlp") / "pipe"
    compile_spec(f"{ROOT}/tests/models.py:mlp", out, CompileOptions(stages=2), report=False)
    return out / "artifacts"


def _paths(value, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (keys and list indices), the value itself excluded."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    paths = []
    for key, child in items:
        paths.append(prefix + (key,))
        paths.extend(_paths(child, prefix + (key,)))
    return paths


def _corrupted(text: str, kind: str, position: int, choice: int) -> str:
    """``text`` truncated, or with the value at a path (picked by ``position``) deleted (a list
    item is replaced instead), replaced by a value of another type or a number out of range
    (``WRONG_VALUES``), or by a name that is no identifier (``INJECTIONS``)."""
    if kind == "truncate":
        return text[: position % len(text)]
    data = json.loads(text)
    paths = _paths(data)
    path = paths[position % len(paths)]
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        values = INJECTIONS if kind == "inject" else WRONG_VALUES
        parent[path[-1]] = values[choice % len(values)]
    return json.dumps(data)


def _runs_no_injected_code(source: str) -> bool:
    """No ``__import__`` or ``.system`` and no ``import os`` in the code (strings may hold them)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "__import__":
            return False
        if isinstance(node, ast.Attribute) and node.attr == "system":
            return False
        if isinstance(node, ast.Import) and any(a.name == "os" for a in node.names):
            return False
    return True


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(["graph", "partition"]),
    kind=st.sampled_from(["truncate", "replace", "inject", "delete"]),
    position=st.integers(0, 10**6),
    choice=st.integers(0, 100),
)
def test_corrupted_artefacts_give_a_clear_error_and_write_nothing(
    tmp_path_factory, mlp_artifacts, name, kind, position, choice
):
    """A corrupted graph.json or partition.json is refused with one of autopipe's errors when
    loaded or generated, and leaves nothing behind; one that is accepted (a harmless change)
    generates Python that parses and runs no injected code."""
    folder = tmp_path_factory.mktemp("corrupt")
    for artefact in ("graph", "partition"):
        text = (mlp_artifacts / f"{artefact}.json").read_text()
        if artefact == name:
            text = _corrupted(text, kind, position, choice)
        (folder / f"{artefact}.json").write_text(text)
    out = folder / "out"
    try:
        graph = load_graph(folder / "graph.json")
        part = Partition.load(folder / "partition.json")
        # let a corrupted graph reach code generation
        part = dataclasses.replace(part, graph_digest=graph_digest(graph))
        generate_step(graph, part, out)
    except AutopipeError as exc:
        assert str(exc)
        assert sorted(p.name for p in folder.iterdir()) == ["graph.json", "partition.json"]
        return
    for path in out.glob("*.py"):  # the generated modules (runtime/ is copied verbatim)
        assert _runs_no_injected_code(path.read_text()), path
