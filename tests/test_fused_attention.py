"""autopipe/runtime/core/fused_attention.py: on the dry run's fake CUDA device, attention runs the
fused kernel a GPU picks (flash for half precision without a mask, memory-efficient otherwise),
which keeps one log-sum-exp per row for the backward, not the probabilities the math path keeps
(which a torch without CUDA falls back to); outside the dry run, torch's own path again."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.runtime.dry_run import Fakes, Rehearsal

DEVICE = torch.device("cuda", 0)
HEADS, KV_HEADS, SEQ, HEAD = 8, 2, 1024, 64


class Operators(TorchDispatchMode):
    """The operators run, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def attend(tmp_path, dtype, mask):
    """Attention (causal, or under a boolean mask) of grouped heads on fake CUDA, forward and
    backward: the operators its forward ran, the backward autograd recorded for its output, the
    live bytes it held at its peak, the gradients' shapes."""
    with Fakes("cuda", 0, 1) as fakes:
        mode = Rehearsal(DEVICE, fakes.cpu_only_torch, tmp_path)
        spy = Operators()
        with FakeTensorMode(allow_non_fake_inputs=True), mode:
            query = torch.zeros(1, HEADS, SEQ, HEAD, device=DEVICE, dtype=dtype).requires_grad_()
            key = torch.zeros(1, KV_HEADS, SEQ, HEAD, device=DEVICE, dtype=dtype).requires_grad_()
            allowed = torch.ones(SEQ, SEQ, device=DEVICE, dtype=torch.bool).tril() if mask else None
            with spy:  # (autograd's engine runs the backward outside it: see Rehearsal)
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key, key, attn_mask=allowed, is_causal=not mask, enable_gqa=True
                )
            backward = out.grad_fn.name()
            out.float().sum().backward()
            shapes = [tuple(query.grad.shape), tuple(key.grad.shape)]
    return spy.names, backward, mode.peak, shapes


@pytest.mark.parametrize(
    "dtype, mask, kernel",
    [
        (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
        (torch.float32, False, "_scaled_dot_product_efficient_attention"),
        (torch.bfloat16, True, "_scaled_dot_product_efficient_attention"),
    ],
)
def test_attention_runs_the_kernel_a_gpu_picks(tmp_path, dtype, mask, kernel):
    names, backward, peak, shapes = attend(tmp_path, dtype, mask)
    assert kernel in names, names
    assert backward == "".join(w.capitalize() for w in kernel.split("_")) + "Backward0"
    assert "_safe_softmax" not in names and "bmm" not in names  # no math path
    assert shapes == [(1, HEADS, SEQ, HEAD), (1, KV_HEADS, SEQ, HEAD)]
    # one heads x sequence x sequence matrix of probabilities would be 32 MiB in float32 (the
    # mask's additive bias, sequence x sequence, is what a GPU's kernel reads too)
    probabilities = HEADS * SEQ * SEQ * 4
    assert peak < probabilities / 2, peak


def test_outside_the_dry_run_torch_picks_again():
    key = "AutogradCUDA"
    registered = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not registered("aten::scaled_dot_product_attention", key)
    with Fakes("cuda", 0, 1):
        assert registered("aten::scaled_dot_product_attention", key)
    assert not registered("aten::scaled_dot_product_attention", key)
