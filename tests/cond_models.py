"""Models with ``torch.cond`` for tests/test_control_flow.py, as spec functions, with their
data (``cond_batch``) and loss (``mse``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, ROWS = 16, 4


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h):
        return self.norm(torch.tanh(self.lin(h)))


class CondNet(nn.Module):
    """Layers before and after a ``torch.cond`` whose branches run submodules of their own (their
    parameters become operands), return two tensors, and create tensors (a constant, a range)
    and a no-grad value inside."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.pre = nn.Linear(width, width)
        self.pos = Block(width)
        self.neg = Block(width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def positive(self, x, h):
        y = self.pos(h) * 2 + x
        return y, y.mean(-1)

    def negative(self, x, h):
        with torch.no_grad():
            shift = h.mean() * 0.0
        scale = torch.linspace(0.5, 1.5, h.shape[-1]) * torch.tensor(2.0)
        y = self.neg(h) * scale - x + shift
        return y, -y.amax(-1)

    def forward(self, x):
        h = torch.tanh(self.pre(torch.tanh(self.inp(x))))
        y, side = torch.cond(x.sum() > 0, self.positive, self.negative, (x, h))
        y = torch.tanh(self.mid(y)) + y
        return self.out(y).squeeze(-1) + side


def _example(sign: float):
    torch.manual_seed(0)
    model = CondNet()
    x = torch.randn(ROWS, WIDTH).abs() * sign
    return model, (x,), {}, torch.zeros(ROWS)


def cond_true():
    """CondNet on an example taking the true branch (x.sum() > 0)."""
    return _example(1.0)


def cond_false():
    """The same weights on an example taking the false branch."""
    return _example(-1.0)


def cond_batch(step: int, microbatches: int = 4):
    """Microbatches of alternating sign: each step runs both branches."""
    g = torch.Generator().manual_seed(7000 + step)
    x = torch.randn(ROWS * microbatches, WIDTH, generator=g).abs()
    signs = torch.tensor([(-1.0) ** (i + step) for i in range(microbatches)])
    x = x * signs.repeat_interleave(ROWS)[:, None]
    return (x,), {}, x.sum(-1).sin()


def mse(output, target):
    return F.mse_loss(output, target)


class NestedCond(nn.Module):
    def forward(self, x):
        def inner(t):
            return torch.cond(t.mean() > 1, lambda u: u * 2, lambda u: u + 1, (t,))

        return torch.cond(x.sum() > 0, inner, lambda t: t - 1, (x,))


def nested_cond():
    return NestedCond(), (torch.randn(2, 4),)


class WhileLoop(nn.Module):
    def forward(self, x):
        from torch._higher_order_ops import while_loop

        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2), (torch.tensor(0), x))[1]


def while_loop_model():
    return WhileLoop(), (torch.randn(2, 4),)


class GatedLayer(nn.Module):
    """A layer that runs one of two linear maps, chosen by the sign of its input's mean."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, h):
        return torch.cond(
            h.mean() > 0, lambda t: torch.relu(self.up(t)), lambda t: self.down(t) * 0.5, (h,)
        )


class GatedStack(nn.Module):
    """Several layers, each holding a torch.cond (one cond per layer call)."""

    def __init__(self, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(GatedLayer(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return self.out(x).squeeze(-1)


def gated_stack(sign: float = 1.0):
    torch.manual_seed(0)
    model = GatedStack()
    x = torch.randn(ROWS, WIDTH).abs() * sign
    return model, (x,)


def gated_stack_negative():
    return gated_stack(-1.0)


class NoGradCond(nn.Module):
    """torch.cond inside torch.no_grad(): torch.export would drop the region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            g = torch.cond(h.sum() > 0, lambda t: self.b(t), lambda t: t - 1, (h,))
        return (h * g).sum()


def no_grad_cond():
    return NoGradCond(), (torch.randn(2, 4),)


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3  # not the derivative of forward: only a custom backward gives it


class FunctionInBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return torch.cond(h.sum() > 0, lambda t: Double.apply(t), lambda t: t - 1, (h,)).sum()


def function_in_branch():
    return FunctionInBranch(), (torch.randn(2, 4),)
