"""autopipe/profiling/dropout.py: dropout as a GPU runs it (a boolean mask saved) on the fake CPU
tensors of a GPU spec's analytic profile, and what the profile then counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses import FakeTensorMode

from autopipe.compiler import CompileOptions, trace_step
from autopipe.profiling import device_spec, profile
from autopipe.profiling.dropout import gpu_dropout
from autopipe.spec import load_example

from conftest import spec


def _saved_bytes(run) -> tuple[int, torch.Tensor]:
    """The bytes autograd saves for ``run()``'s backward, and its output."""
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(t.numel() * t.element_size() for t in saved), out


def test_fake_cpu_tensors_keep_a_gpus_boolean_mask():
    x = torch.randn(64, 32, requires_grad=True)
    with FakeTensorMode() as fakes:
        fake = fakes.from_tensor(x)
        cpu, _ = _saved_bytes(lambda: torch.nn.functional.dropout(fake, 0.1, True))
        assert cpu == 64 * 32 * 4  # the CPU's: a random tensor of the input's dtype
        with gpu_dropout():
            gpu, out = _saved_bytes(lambda: torch.nn.functional.dropout(fake, 0.1, True))
            assert gpu == 64 * 32  # one byte an element, as torch's native_dropout keeps
            assert type(out.grad_fn).__name__ == "NativeDropoutBackward0"
            assert out.shape == x.shape and out.dtype == x.dtype
            # evaluation: nothing dropped, nothing saved
            kept, _ = _saved_bytes(lambda: torch.nn.functional.dropout(fake, 0.1, False))
            assert kept == 0
        again, _ = _saved_bytes(lambda: torch.nn.functional.dropout(fake, 0.1, True))
        assert again == cpu  # removed on exit


def test_real_tensors_still_drop_out():
    torch.manual_seed(0)
    x = torch.ones(1000, requires_grad=True)
    with gpu_dropout():
        out = torch.nn.functional.dropout(x, 0.5, True)
    kept = out.detach() != 0
    assert 300 < int(kept.sum()) < 700
    assert torch.equal(out.detach()[kept], torch.full((int(kept.sum()),), 2.0))
    out.sum().backward()
    assert torch.equal(x.grad, kept.float() * 2)


@pytest.fixture(scope="module")
def gpt2_graph():
    example = load_example(spec("examples/gpt2.py:build"))  # dropout 0.1
    return trace_step(example, CompileOptions(stages=1))


def test_a_gpu_specs_profile_counts_the_boolean_mask(gpt2_graph):
    """The embeddings' dropout of the gallery's GPT-2 saves its mask alone: one byte an element in
    the profile of an H100 (torch's fused kernel), four in the same spec run as a CPU's (its
    random tensor), and less time (one kernel, moving less, where the CPU's draws, scales and
    multiplies)."""
    graph = gpt2_graph
    (unit,) = [u.index for u in graph.units if u.label == "transformer.drop (Dropout)"]
    (dropout,) = [n for n in graph.units[unit].nodes if "dropout" in graph[n].target]
    elements = graph[dropout].meta.numel
    gpu = profile(graph, spec=device_spec("H100")).units[unit]
    as_cpu = replace(device_spec("H100"), device_type="cpu")
    cpu = profile(graph, spec=as_cpu).units[unit]
    assert gpu.activations == elements
    assert cpu.activations == 4 * elements
    assert gpu.forward < cpu.forward
