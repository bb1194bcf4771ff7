"""Mixed precision as ``train.py --bf16`` runs a stage: bfloat16 autocast over the model's
(fp32) parameters.

A profile for ``--bf16`` (``autopipe compile --bf16``) runs each unit's forward under it, as the
stage runs: products, convolutions and attention in bf16 (timed at the device's bf16 rates,
their outputs and what they save for backward in bf16), the operators autocast's policy keeps
in fp32 in fp32, and each parameter a product reads cast to bf16 once per forward (the copy
autograd then saves: one per microbatch in flight). The values handed from unit to unit are
made in the dtypes autocast gives them (:func:`autocast_dtypes`), not in the traced ones.
For a GPU's spec the analytic profile (on fake CPU tensors) follows CUDA's policy, not the
CPU's (:func:`cuda_policy`): CUDA computes in fp32 what the CPU's leaves in bf16 (``pow``, ``exp``,
``rsqrt``, layer norm, softmax, ...: a tanh GELU's chain then runs and saves in fp32 on a GPU),
and lowers a few products the CPU's does not (``mv``, ``addmv``, ``addr``, the RNN cells).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._subclasses import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_any, tree_leaves, tree_map

from ..ir import Graph
from ..ir.interpreter import empty_placeholder, run_nodes
from ..runtime.core.aten_kernels import aten_kernels
from ..runtime.core.mixed_precision import AUTOCAST_DTYPE, bf16_autocast

__all__ = [
    "AUTOCAST_DTYPE",
    "ParameterCasts",
    "autocast",
    "autocast_dtypes",
    "changed_dtypes",
    "cuda_policy",
    "unit_dtypes",
]


def autocast(device_type: str, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device_type`` as train.py's ``--bf16`` enters it (the runtime's own
    context), or nothing."""
    return bf16_autocast(device_type if bf16 else None)


def autocast_dtypes(graph: Graph, device: torch.device) -> dict[str, torch.dtype]:
    """The tensor values of ``graph`` whose dtype under bf16 autocast differs from the traced
    one (a product's output: bf16), by node name, from one forward of the whole graph on fake
    tensors."""
    env: dict[str, object] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), autocast(device.type, True):
        for node in graph.nodes:
            if node.is_placeholder:
                env[node.name] = empty_placeholder(graph, node, device)
        run_nodes(graph.calls, env, device, graph.functions)
    return changed_dtypes(graph, env)


def changed_dtypes(graph: Graph, values: Mapping[str, object]) -> dict[str, torch.dtype]:
    """Of ``values`` (by node name, from a run under autocast), the tensors whose dtype
    differs from the traced one, -> their dtype."""
    changed = {}
    for name, value in values.items():
        meta = graph[name].tensor_meta
        if isinstance(value, torch.Tensor) and meta is not None and value.dtype != meta.dtype:
            changed[name] = value.dtype
    return changed


class ParameterCasts(TorchDispatchMode):
    """Records the copies autocast makes of ``parameters`` (storages of parameter tensors): a
    product's bf16 weight, which autograd saves for the backward. ``casts``: the copies'
    storages; ``sources``: the parameters copied, in the order of their copies."""

    def __init__(self, parameters: set[StorageWeakRef]):
        super().__init__()
        self.parameters = parameters
        self.casts: set[StorageWeakRef] = set()
        self.sources: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            source = args[0]
            if StorageWeakRef(source.untyped_storage()) in self.parameters:
                self.casts.add(StorageWeakRef(out.untyped_storage()))
                self.sources.append(source)
        return out


def unit_dtypes(names: list[str], dtypes: Mapping[str, torch.dtype]) -> str:
    """What a unit's cached profile is keyed by beyond its structure: its inputs' dtypes under
    autocast ("" without any change)."""
    found = [str(dtypes[n]) if n in dtypes else "" for n in names]
    return repr(found) if any(found) else ""


#: operators CUDA's autocast computes in fp32 (torch's autocast op reference), which the CPU's
#: leaves in the dtype of their inputs
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm", "linalg_vector_norm",
    "linalg_matrix_norm", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
)  # fmt: skip
#: products CUDA's autocast computes in bf16 that the CPU's does not
_CUDA_LOWER = (
    "addmv", "addr", "mv", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
)  # fmt: skip
#: operators CUDA's autocast runs in the widest floating dtype of their inputs
_CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put",
    "scatter_add", "tensordot",
)  # fmt: skip
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


@contextlib.contextmanager
def cuda_policy() -> Iterator[None]:
    """Within it, bf16 autocast on fake CPU tensors casts as CUDA's does (see the module's
    text): kernels for the CPU's autocast key of the operators where the policies differ and
    the CPU has none, removed on exit. Real tensors are not cast (those operators then run
    below autocast)."""
    policies = (
        (_CUDA_FP32, torch.float32),
        (_CUDA_LOWER, AUTOCAST_DTYPE),
        (_CUDA_PROMOTE, None),
    )
    kernels = [
        (overload, _casting(overload, dtype), "AutocastCPU")
        for names, dtype in policies
        for name in names
        for overload in _overloads(name)
    ]
    with aten_kernels(kernels):
        yield


def _overloads(name: str) -> list[str]:
    """The functional overloads of ``aten.name`` that have no CPU autocast kernel of their own
    (``pow.Tensor_Scalar``, ...)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    found = []
    for overload in packet.overloads():
        qualified = name if overload == "default" else f"{name}.{overload}"
        if getattr(packet, overload)._schema.is_mutable:
            continue
        try:
            has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
                f"aten::{qualified}", "AutocastCPU"
            )
        except RuntimeError:  # a TorchScript overload (acos.int): no dispatcher operator
            continue
        if has_kernel:
            continue
        found.append(qualified)
    return found


def _casting(qualified: str, dtype: torch.dtype | None) -> Callable[..., Any]:
    """A CPU autocast kernel for ``aten.qualified`` that casts its floating tensor arguments
    (on fake tensors) to ``dtype`` (None: the widest of theirs) and runs it below autocast."""
    name, _, overload = qualified.partition(".")
    op = getattr(getattr(torch.ops.aten, name), overload or "default")
    others = (torch.float32, AUTOCAST_DTYPE, torch.float16)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not tree_any(lambda v: isinstance(v, FakeTensor), (args, kwargs)):
                return op(*args, **kwargs)  # a real tensor: not cast
            to = dtype
            if to is None:  # promote: the widest floating dtype among the tensors
                floating = [
                    v.dtype
                    for v in tree_leaves((args, kwargs))
                    if isinstance(v, torch.Tensor) and v.dtype in others
                ]
                to = max(floating, key=lambda d: d.itemsize, default=None)

            def cast(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.dtype in others and value.dtype != to:
                    return value.to(to)
                return value

            if to is not None:
                args, kwargs = tree_map(cast, (args, kwargs))
            return op(*args, **kwargs)

    return kernel
