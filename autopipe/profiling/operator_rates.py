"""Rates of a CPU's operators by size, measured on the layers models are made of.

On a GPU an elementwise operator streams memory and the analytic profile's copy table times it.
On a CPU, with one thread per rank, many are bound by their arithmetic instead: a tanh-approximate
GELU, a dropout drawing one random number per element, a batch norm's two passes over channels,
a convolution through oneDNN at a rate a square product does not predict. Timing each operator
kind alone would need argument shapes for each; instead the layers models are made of (a
GPT-2-style block with GELU and dropout, its attention written out and through SDPA, a
Llama-style block with RMS norm, rotary embeddings and a SiLU-gated MLP, an embedding and a
cross-entropy loss, the elementwise chains models write out (GPT-2's tanh GELU formula, an erf
GELU, a sigmoid gate), a convolution block with batch norm, ReLU and max pooling) run forward
and backward at a few sizes under a dispatch mode that times every ATen operator they call, and
each operator's rate is kept by size: FLOPs per second where torch's counter gives it FLOPs,
elements written per second otherwise (``op.NAME.DTYPE`` tables of the device spec). The
analytic profile times an operator it has a table for by it (:meth:`DeviceSpec.operator_time`),
and the rest as before.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_flatten

from .devices import RateTable
from .flops import flop_counter

__all__ = ["operator_size", "operator_tables"]

#: tokens (batch x sequence) of the transformer layers, and spatial sides of the convolution
#: block, measured
_TOKENS = (128, 512, 2048)
_SIDES = (8, 16, 32)
_WIDTH = 256
_REPEATS = 5


def operator_size(flops: float, outputs: list[torch.Tensor]) -> float:
    """The size an operator's table is keyed by: its FLOPs, else the elements it writes."""
    return flops if flops > 0 else float(sum(t.numel() for t in outputs))


@dataclass
class _Call:
    """One operator call: its name, dtype, the elements it wrote, its FLOPs and seconds."""

    name: str
    dtype: str
    elements: float
    flops: float = 0.0
    seconds: float = 0.0


class _OperatorLog(TorchDispatchMode):
    """Records every kernel-launching operator dispatched inside it, in order: timed (a CPU's
    operators are synchronous), or with the FLOPs ``counter`` (a dispatch mode under it) gives
    it. Timing and counting run in separate passes: the counter's own time would otherwise be
    charged to the operators."""

    def __init__(self, counter: FlopCounterMode | None = None) -> None:
        super().__init__()
        self.counter = counter
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.counter.get_total_flops() if self.counter is not None else 0
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - started
        schema = func._schema
        if schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable:
            return out  # a view: no kernel
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dtype = next((t.dtype for t in inputs if t.is_floating_point()), None)
        if not outputs or dtype is None:
            return out
        call = _Call(func._opname, str(dtype).removeprefix("torch."), operator_size(0, outputs))
        if self.counter is not None:
            call.flops = self.counter.get_total_flops() - before
        else:
            call.seconds = seconds
        self.calls.append(call)
        return out


class _GptBlock(nn.Module):
    """GPT-2's block: attention written out (scores, mask, softmax, dropout), or ``fused``
    through SDPA with attention dropout, which a CPU runs by its math path (batched products,
    a safe softmax, a dropout draw)."""

    def __init__(self, width: int, fused: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, 4, w // 4).permute(2, 0, 3, 1, 4)
        if self.fused:
            attention = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / (w // 4) ** 0.5
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            attention = self.drop(scores.masked_fill(~mask, float("-inf")).softmax(-1)) @ v
        x = x + self.drop(self.out(attention.transpose(1, 2).reshape(b, s, w)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh")))


class _LlamaBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.gate, self.up = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, 4, w // 4).permute(2, 0, 3, 1, 4)
        angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.ones(w // 4)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

        attention = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, w))
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _pointwise(x: torch.Tensor) -> torch.Tensor:
    """The elementwise chains models write out themselves: GPT-2's tanh GELU formula
    (``NewGELUActivation``), an exact GELU by ``erf``, a sigmoid gate, a scaled exponent."""
    tanh_gelu = 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
    erf_gelu = x * 0.5 * (1.0 + torch.erf(x / 1.41421356))
    gate = torch.sigmoid(x) * x
    return tanh_gelu + erf_gelu + gate + torch.exp(-x.abs()).clamp(max=1.0)


class _ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)


def _workloads(dtype: torch.dtype) -> list[Callable[[], None]]:
    """Forward and backward passes of the layers, at each size."""
    torch.manual_seed(0)
    gpt, llama = _GptBlock(_WIDTH).to(dtype), _LlamaBlock(_WIDTH).to(dtype)
    fused_gpt = _GptBlock(_WIDTH, fused=True).to(dtype)
    embedding = nn.Embedding(1000, _WIDTH).to(dtype)
    conv = _ConvBlock(64).to(dtype)
    passes: list[Callable[[], None]] = []
    for tokens in _TOKENS:
        ids = torch.randint(0, 1000, (tokens // 128, 128))

        def transformer(ids: torch.Tensor = ids) -> None:
            x = embedding(ids)
            logits = (llama(fused_gpt(gpt(x))) @ embedding.weight.t()).float()
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

        wide = torch.randn(tokens, 4 * _WIDTH, dtype=dtype, requires_grad=True)

        def pointwise(wide: torch.Tensor = wide) -> None:
            _pointwise(wide).sum().backward()

        passes += [transformer, pointwise]
    for side in _SIDES:
        images = torch.randn(4, 64, side, side, dtype=dtype)

        def convolution(images: torch.Tensor = images) -> None:
            conv(images).float().sum().backward()

        passes.append(convolution)
    return passes


def operator_tables(
    dtypes: tuple[torch.dtype, ...] = (torch.float32,), log: Callable[[str], None] = print
) -> dict[str, RateTable]:
    """``op.NAME.DTYPE`` -> the operator's rate by size (see the module's text), measured on
    this CPU in the threads torch has now."""
    tables: dict[str, RateTable] = {}
    for dtype in dtypes:
        passes = _workloads(dtype)
        for work in passes:  # warm-up
            work()
        with flop_counter() as counter, _OperatorLog(counter) as counted:
            for work in passes:
                work()
        samples: dict[tuple[str, str, float], list[float]] = defaultdict(list)
        for _ in range(_REPEATS):
            with _OperatorLog() as timed:
                for work in passes:
                    work()
            if [c.name for c in timed.calls] != [c.name for c in counted.calls]:
                continue  # not the same operators as counted: not attributable
            for call, count in zip(timed.calls, counted.calls):
                size = count.flops if count.flops > 0 else call.elements
                samples[(call.name, call.dtype, size)].append(call.seconds)
        by_operator: dict[str, dict[float, float]] = defaultdict(dict)
        for (name, type_name, size), seconds in samples.items():
            by_operator[f"op.{name}.{type_name}"][size] = size / max(
                statistics.median(seconds), 1e-9
            )
        for key, points in by_operator.items():
            tables[key] = RateTable(tuple(sorted(points.items())))
        log(f"operators measured in {str(dtype).removeprefix('torch.')}: {len(by_operator)}")
    return tables
