"""Models with custom ``torch.autograd.Function``s whose backward is not autograd's derivative of
their forward, for tests/test_functions.py: a pipeline that lost the custom backward would train
differently. Spec functions return (model, args, kwargs, target); ``batch`` feeds train.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

BATCH = 4


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds in forward, passes the gradient through unchanged
    (autograd's derivative of round is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class ScaledSquare(torch.autograd.Function):
    """``scale * x * x``, with a deliberately different backward ``grad * scale * (x + 1)``
    (autograd's would be ``grad * 2 * scale * x``): ctx.save_for_backward and a ctx attribute."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale * (x + 1.0), None


class GatedProduct(torch.autograd.Function):
    """``forward`` without ctx and ``setup_context``: two tensor arguments, two results, the
    second (a mask) marked non-differentiable; the first argument's gradient is doubled."""

    @staticmethod
    def forward(a, b):
        return a * b, (a > 0).to(a.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b = inputs
        ctx.save_for_backward(a, b)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, grad_mask):
        a, b = ctx.saved_tensors
        return 2 * grad * b, grad * a


class FunctionMLP(nn.Module):
    """Linear layers joined by the custom functions above; ``plain=True`` computes the same
    forward with differentiable torch operations instead (autograd's gradients)."""

    def __init__(self, plain: bool = False):
        super().__init__()
        self.plain = plain
        self.layers = nn.ModuleList(
            [nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)]
        )

    def forward(self, x):
        h = self.layers[0](x)
        h = (torch.round(h * 4) if self.plain else RoundSTE.apply(h * 4)) / 4
        h = self.layers[1](h)
        t = torch.tanh(h)
        h = t * t * 0.5 if self.plain else ScaledSquare.apply(t, 0.5)
        h = self.layers[2](h)
        if self.plain:
            gated, mask = h * torch.sigmoid(h), (h > 0).to(h.dtype)
        else:
            gated, mask = GatedProduct.apply(h, torch.sigmoid(h))
        return self.layers[3](gated + mask).squeeze(-1)


def function_mlp(plain: bool = False):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 16, generator=g)
    return FunctionMLP(plain), (x,), {}, x.sum(-1).sin()


def plain_mlp():
    return function_mlp(plain=True)


def mse(output, target):
    return F.mse_loss(output, target)


def rounded_mse(output, target):
    """A loss calling a custom function too: the generated loss.py defines its class."""
    return F.mse_loss(RoundSTE.apply(output * 8) / 8, target)


def batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(7000 + step)
    x = torch.randn(BATCH * microbatches, 16, generator=g)
    return (x,), {}, x.sum(-1).sin()


# -- functions autopipe refuses, with the reason it gives ---------------------------------------
class BranchingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if x.max() > 1:  # a Python branch on tensor values
            return grad * 3
        return grad


class NumpyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.numpy() * 2)


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class WithStatistic(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2


class Wrapped(nn.Module):
    """Linear -> the function -> Linear."""

    def __init__(self, function):
        super().__init__()
        self.function = function
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.function.apply(self.a(x).clone())
        return self.b(h[0] if isinstance(h, tuple) else h).sum()


def refused(function):
    torch.manual_seed(0)
    return Wrapped(function), (torch.randn(2, 4),)


def branching_backward():
    return refused(BranchingBackward)


def numpy_backward():
    return refused(NumpyBackward)


def in_place():
    return refused(InPlace)


def with_statistic():
    return refused(WithStatistic)


class TwoShapes(nn.Module):
    """One function called on two shapes (two generated classes) in different layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = ScaledSquare.apply(self.a(x), 0.5)
        h = ScaledSquare.apply(self.b(h), 0.5)
        h = ScaledSquare.apply(self.c(h), 0.25)
        return h.sum(-1)


def two_shapes():
    torch.manual_seed(0)
    return TwoShapes(), (torch.randn(BATCH, 8),)


class Float32Matmul(torch.autograd.Function):
    """``x @ w`` in float32 even under autocast (``custom_fwd(cast_inputs=...)``), with a
    backward that keeps the float32 result's gradient scaled by 2."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return 2 * grad @ w.t(), x.t() @ grad


class AutocastSquare(torch.autograd.Function):
    """``x * x`` under the caller's autocast, its backward under the forward's autocast state
    (``custom_bwd``): a matmul in the backward runs in bfloat16 there."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x @ w) * 2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class AutocastMLP(nn.Module):
    """Custom functions with torch.amp decorators called inside a CPU bfloat16 autocast region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)
        self.w1 = nn.Parameter(torch.randn(32, 32) / 6)
        self.w2 = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
            h = Float32Matmul.apply(h, self.w1)
            h = AutocastSquare.apply(torch.tanh(h), self.w2)
            return self.b(h).float().sum(-1)


def autocast_mlp():
    torch.manual_seed(0)
    return AutocastMLP(), (torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1)),)


class CondBranch(nn.Module):
    """A custom function inside a torch.cond branch: TorchDynamo traces the branch and keeps
    only the function's forward, so autopipe refuses it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h = torch.cond(h.sum() > 0, lambda t: RoundSTE.apply(t * 2), lambda t: t - 1, (h,))
        return self.b(h).sum()


def cond_branch():
    torch.manual_seed(0)
    return CondBranch(), (torch.randn(2, 4),)


def bloom_on_meta():
    """BLOOM (GeLUFunction in training mode) built on the meta device: traced with fake weights."""
    from zoo.models import bloom

    with torch.device("meta"):
        return bloom()


class AttributeContext(torch.autograd.Function):
    """Tensors kept as a ctx attribute (a tuple, not save_for_backward), a non-tensor argument
    read in backward, ctx.needs_input_grad, ctx.set_materialize_grads(False) with a result the
    model does not use; the first argument's gradient is tripled."""

    @staticmethod
    def forward(ctx, x, y, shape):
        ctx.inputs = (x, y)
        ctx.shape = shape
        ctx.set_materialize_grads(False)
        return x * y, x + y

    @staticmethod
    def backward(ctx, grad_product, grad_sum):
        x, y = ctx.inputs
        grad_x = (3 * grad_product * y).reshape(ctx.shape)
        if grad_sum is not None:
            grad_x = grad_x + grad_sum
        grad_y = grad_product * x if ctx.needs_input_grad[1] else None
        return grad_x, grad_y, None


class ContextMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = self.a(x)
        product, _ = AttributeContext.apply(h, x.sin(), h.shape)  # x.sin() needs no gradient
        return self.c(torch.tanh(self.b(product))).squeeze(-1)


def context_mlp():
    torch.manual_seed(0)
    return ContextMLP(), (torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1)),)
