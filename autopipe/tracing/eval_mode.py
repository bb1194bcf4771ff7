"""The pass that finds the arguments ``torch.export`` fixed to training mode
(:mod:`autopipe.ir.eval_mode`): each one gets its eval-mode value in the node's ``eval_args``.

- dropout and its variants (``train``), RReLU (``training``): off in eval mode;
- batch norm (``training``) and instance norm (``use_input_stats``) over running statistics:
  eval mode normalises with them and leaves them as they are (without running statistics both
  use the batch's in either mode, as torch's modules do);
- attention's ``dropout_p``: 0 in eval mode (``F.scaled_dot_product_attention(..., dropout_p=
  self.dropout if self.training else 0.0)``, the way Hugging Face models write it);
- batch norm's count of batches (``num_batches_tracked += 1``): adds 0 in eval mode.

A flag the model fixed itself (``F.dropout(x, p, training=True)``) is traced as the same
constant, so it is read as the mode too: a model that keeps dropout on in eval mode is not told
apart (the README says so).
"""

from __future__ import annotations

from ..checks import op_overload
from ..ir import Node, Ref
from ..ir.eval_mode import ATTENTION, BATCH_COUNT, MODE_FLAGS, STATISTICS_FLAGS, eval_value_of

__all__ = ["mark_eval_arguments"]

#: the buffer batch norm counts its batches in
_COUNTER = "num_batches_tracked"


def mark_eval_arguments(nodes: list[Node]) -> None:
    """Set ``eval_args`` on every node of ``nodes`` (a traced graph's, in program order) whose
    arguments training mode fixed."""
    buffers = {n.name: n.target for n in nodes if n.kind == "buffer"}
    for node in nodes:
        if node.kind != "call" or op_overload(node.target) is None:
            continue
        eval_args = dict(node.eval_args)
        flag = MODE_FLAGS.get(node.target)
        if flag is not None and eval_value_of(node, flag) is True:
            eval_args[flag] = False
        flag = STATISTICS_FLAGS.get(node.target)
        if (
            flag is not None
            and eval_value_of(node, flag) is True
            and eval_value_of(node, "running_mean") is not None
        ):
            eval_args[flag] = False
        if node.target in ATTENTION:
            p = eval_value_of(node, "dropout_p")
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p != 0:
                eval_args["dropout_p"] = 0.0 if isinstance(p, float) else 0
        if _counts_batches(node, buffers):
            eval_args[BATCH_COUNT[1]] = 0
        node.eval_args = eval_args


def _counts_batches(node: Node, buffers: dict[str, str]) -> bool:
    """``num_batches_tracked += 1`` of a batch norm in training mode."""
    if node.target != BATCH_COUNT[0] or len(node.args) != 2 or node.kwargs:
        return False
    counter, step = node.args
    return (
        isinstance(counter, Ref)
        and buffers.get(counter.name, "").rsplit(".", 1)[-1] == _COUNTER
        and type(step) is int
        and step == 1
    )
