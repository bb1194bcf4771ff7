"""Operators from outside torch: which module registers each, so that a generated package can
import it (and say so when it is missing) instead of failing on an unknown ``torch.ops`` name.

Libraries register their own operators (``transformers`` routes mixture-of-experts layers
through ``torch.ops.transformers.grouped_mm_fallback``); an exported graph keeps them as calls,
which only run in a process that imported the library.
"""

from __future__ import annotations

import torch
from torch._library.custom_ops import OPDEFS

from ..checks import is_fqn
from ..errors import TraceError

#: operator namespaces torch registers itself
TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "higher_order",
        "quantized",
        "_quantized",
        "quantized_decomposed",
        "profiler",
        "_c10d_functional",
        "c10d_functional",
        "_c10d_functional_autograd",
        "_dtensor",
        "inductor",
        "pippy",  # torch.distributed.pipelining's pipe_split() marker
        "fsdp",
        "c10d",
        "mkldnn",
        "onednn",
        "rngprims",
        "debugprims",
    }
)


def operator_provider(op: torch._ops.OpOverload) -> str | None:
    """The module outside torch whose import registers ``op``; None for torch's own operators.
    Raises TraceError for an operator whose origin cannot be found."""
    qualname = op._schema.name  # "namespace::name"
    if qualname in ("autopipe::function", "autopipe::module"):
        return None  # a custom autograd function, a module kept whole: generated as such
    opdef = OPDEFS.get(qualname)
    if opdef is not None:
        module = getattr(opdef._init_fn, "__module__", None)
        if module and module.split(".")[0] != "torch" and is_fqn(module):
            return module
        if module and module.split(".")[0] == "torch":
            return None
    if qualname.split("::")[0] in TORCH_NAMESPACES:
        return None
    raise TraceError(
        f"the model calls the operator torch.ops.{qualname.replace('::', '.')}, which is "
        "registered outside torch by code autopipe cannot find (only operators defined with "
        "torch.library.custom_op name their module). The generated package could not run it. "
        "Define the operator with torch.library.custom_op in an importable module, or build the "
        "model so that it calls torch operators instead"
    )
