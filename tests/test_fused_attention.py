"""autopipe/runtime/core/fused_attention.py: on the dry run's fake CUDA device, attention runs the
fused kernel a GPU picks (flash for half precision without a mask, memory-efficient otherwise),
which keeps one log-sum-exp per row for the backward, not the probabilities the math path keeps
(which a torch without CUDA falls back to); outside the dry run, torch's own path again."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.runtime.core.fused_attention import fused_kernels
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


def attend(tmp_path, dtype, mask, kv_heads):
    """Attention (causal, or under a boolean mask) of ``kv_heads`` key/value heads (grouped,
    fewer than the query's) on fake CUDA, forward and
    backward: the operators its forward ran, the backward autograd recorded for its output, the
    live bytes it held at its peak, the gradients' shapes."""
    with Fakes("cuda", 0, 1) as fakes:
        mode = Rehearsal(DEVICE, fakes.cpu_only_torch, tmp_path)
        spy = Operators()
        with FakeTensorMode(allow_non_fake_inputs=True), mode:
            query = torch.zeros(1, HEADS, SEQ, HEAD, device=DEVICE, dtype=dtype).requires_grad_()
            key = torch.zeros(1, kv_heads, SEQ, HEAD, device=DEVICE, dtype=dtype).requires_grad_()
            allowed = torch.ones(SEQ, SEQ, device=DEVICE, dtype=torch.bool).tril() if mask else None
            with spy:  # (autograd's engine runs the backward outside it: see Rehearsal)
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, key, key, attn_mask=allowed, is_causal=not mask, enable_gqa=True
                )
            backward = out.grad_fn.name()
            out.float().sum().backward()
            shapes = [tuple(query.grad.shape), tuple(key.grad.shape)]
    return spy.names, backward, mode.setup_peak, shapes  # (no action runs: all is "setup")


@pytest.mark.parametrize(
    "dtype, mask, kv_heads, kernel",
    [
        # flash attention: half precision, no mask, grouped heads read as they are
        (torch.bfloat16, False, KV_HEADS, "_scaled_dot_product_flash_attention"),
        (torch.float32, False, HEADS, "_scaled_dot_product_efficient_attention"),
        (torch.bfloat16, True, HEADS, "_scaled_dot_product_efficient_attention"),
    ],
)
def test_attention_runs_the_fused_kernel_a_gpu_picks(tmp_path, dtype, mask, kv_heads, kernel):
    names, backward, peak, shapes = attend(tmp_path, dtype, mask, kv_heads)
    assert kernel in names, names
    assert backward == "".join(w.capitalize() for w in kernel.split("_")) + "Backward0"
    assert "_safe_softmax" not in names and "repeat_interleave" not in names  # no math path
    assert shapes == [(1, HEADS, SEQ, HEAD), (1, kv_heads, SEQ, HEAD)]
    # one heads x sequence x sequence matrix of probabilities would be 32 MiB in float32 (the
    # mask's additive bias, sequence x sequence, is what a GPU's kernel reads too)
    probabilities = HEADS * SEQ * SEQ * 4
    assert peak < probabilities / 2, peak


@pytest.mark.parametrize("dtype, mask", [(torch.bfloat16, True), (torch.float32, False)])
def test_grouped_heads_the_fused_kernels_cannot_take_run_the_math_path(tmp_path, dtype, mask):
    """Grouped heads under a mask, or in float32: flash attention cannot run them and the
    memory-efficient kernel takes no grouped heads, so a GPU falls back to the math path, which
    keeps the probabilities (what Hugging Face's ``use_gqa_in_sdpa`` avoids by repeating the
    heads itself where there is a mask)."""
    names, _, peak, shapes = attend(tmp_path, dtype, mask, KV_HEADS)
    assert "_safe_softmax" in names and not any("efficient" in n or "flash" in n for n in names)
    assert shapes == [(1, HEADS, SEQ, HEAD), (1, KV_HEADS, SEQ, HEAD)]
    assert peak >= HEADS * SEQ * SEQ * torch.finfo(dtype).bits // 8


def test_real_tensors_keep_torchs_choice():
    """Only fake tensors stand for a GPU's: real ones (another thread's) run torch's own path."""
    query = torch.randn(1, HEADS, 16, HEAD)
    key = torch.randn(1, KV_HEADS, 16, HEAD)
    expected = nn.functional.scaled_dot_product_attention(query, key, key, enable_gqa=True)
    with fused_kernels("cpu"):
        got = nn.functional.scaled_dot_product_attention(query, key, key, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_outside_the_dry_run_torch_picks_again():
    key = "AutogradCUDA"
    registered = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not registered("aten::scaled_dot_product_attention", key)
    with Fakes("cuda", 0, 1):
        assert registered("aten::scaled_dot_product_attention", key)
    assert not registered("aten::scaled_dot_product_attention", key)
