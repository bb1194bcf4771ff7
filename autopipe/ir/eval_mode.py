"""Arguments that depend on the module's mode: what a node computes in eval mode.

``torch.export`` traces the model in training mode and writes the mode into the operators'
arguments as a constant: ``aten.dropout.default(x, 0.1, True)``, ``aten.batch_norm.default(...,
True, 0.1, 1e-05, False)`` (batch statistics, running statistics updated),
``aten.scaled_dot_product_attention.default(q, k, v, None, 0.1)`` (attention dropout), and
batch norm counts its batches with ``aten.add_.Tensor(num_batches_tracked, 1)``. A node's
:attr:`~autopipe.ir.types.Node.eval_args` names each such argument, by its name in the
operator's schema, with the value eval mode gives it (``{"train": False}``); the node's own
arguments stay those of training, which every analysis and the interpreter use. Generated code
reads the module's ``self.training`` there (:func:`mode_slots`), so that ``stage.eval()``
evaluates as ``model.eval()`` does.

The tracer finds these arguments (``autopipe/tracing/eval_mode.py``); :func:`lint_eval_args` is
the invariant the graph's lint checks; :func:`random_in_eval` lists the operators that still draw
random numbers in eval mode (a stochastic depth written as ``if self.training:`` in Python, which
no argument records), for the summary to name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..checks import op_overload, require
from .codec import UnsupportedValue, encode
from .types import Node, Ref, argument_slot

__all__ = [
    "ATTENTION",
    "BATCH_COUNT",
    "MODE_FLAGS",
    "STATISTICS_FLAGS",
    "eval_value_of",
    "lint_eval_args",
    "mode_argument",
    "mode_slots",
    "random_in_eval",
    "random_in_training",
]

#: the argument that is the mode itself: True in training (traced), False in eval mode
MODE_FLAGS = {
    "aten.dropout.default": "train",
    "aten.feature_dropout.default": "train",
    "aten.alpha_dropout.default": "train",
    "aten.feature_alpha_dropout.default": "train",
    "aten.native_dropout.default": "train",
    "aten.rrelu.default": "training",
    "aten.rrelu_with_noise.default": "training",
}
#: the argument that says "normalise with the batch's statistics", which the mode sets when
#: running statistics are passed (False in eval mode)
STATISTICS_FLAGS = {
    "aten.batch_norm.default": "training",
    "aten.native_batch_norm.default": "training",
    "aten._native_batch_norm_legit.default": "training",
    "aten._native_batch_norm_legit_functional.default": "training",
    "aten.instance_norm.default": "use_input_stats",
}
#: operators with an attention dropout probability, ``dropout_p`` (0 in eval mode)
ATTENTION = (
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)
#: batch norm's count of batches, ``num_batches_tracked += 1`` (adds 0 in eval mode)
BATCH_COUNT = ("aten.add_.Tensor", "other")


def mode_argument(target: str) -> str | None:
    """The argument of ``target`` that may depend on the mode, if it has one."""
    if target in ATTENTION:
        return "dropout_p"
    if target == BATCH_COUNT[0]:
        return BATCH_COUNT[1]
    return MODE_FLAGS.get(target) or STATISTICS_FLAGS.get(target)


def mode_slots(node: Node) -> dict[int | str, tuple[Any, Any]]:
    """The arguments of ``node`` that depend on the mode: position (or keyword) -> (value in
    training, value in eval mode)."""
    slots: dict[int | str, tuple[Any, Any]] = {}
    for name, eval_value in node.eval_args.items():
        slot = argument_slot(node, name)
        assert slot is not None  # lint_eval_args: the node passes the argument
        train = node.args[slot] if isinstance(slot, int) else node.kwargs[slot]
        slots[slot] = (train, eval_value)
    return slots


def eval_value_of(node: Node, name: str) -> Any:
    """The value ``node`` passes as its schema argument ``name`` in eval mode (its own
    argument where eval mode keeps it; None where it passes none)."""
    if name in node.eval_args:
        return node.eval_args[name]
    return _training_value_of(node, name)


def lint_eval_args(node: Node, field: str) -> None:
    """``eval_args`` of a call: arguments of the operator's schema that the node passes, with
    plain values (a bool, a number, None) of the argument's kind, other than training's."""
    if not node.eval_args:
        return
    op = op_overload(node.target)
    require(op is not None, f"{field}.eval_args", node.target, "a torch operator's arguments")
    for name, value in node.eval_args.items():
        require(
            name == mode_argument(node.target),
            f"{field}.eval_args",
            name,
            f"the argument of {node.target} that depends on the mode "
            f"({mode_argument(node.target) or 'it has none'})",
        )
        slot = argument_slot(node, name)
        require(
            slot is not None,
            f"{field}.eval_args",
            name,
            f"an argument {node.target} is called with",
        )
        try:
            encode(value)
        except UnsupportedValue:
            require(False, f"{field}.eval_args.{name}", value, "a JSON value")
        train = node.args[slot] if isinstance(slot, int) else node.kwargs[slot]  # type: ignore[index]
        require(
            not isinstance(value, (Ref, list, dict))
            and not isinstance(train, (Ref, list, dict))
            and type(value) is type(train)
            and value != train,
            f"{field}.eval_args.{name}",
            value,
            f"a constant of the kind of its value in training ({train!r}), other than it",
        )


#: Operators that draw random numbers only when one of their arguments says so
_RANDOM_WHEN = {
    "train": lambda value: value is True,
    "training": lambda value: value is True,
    "dropout_p": lambda value: bool(value),
}


def random_in_eval(nodes: Iterable[Node]) -> list[Node]:
    """The calls that draw random numbers in eval mode too: torch operators tagged as seeded
    random (``aten.rand``, ``aten.bernoulli``, ...), other than those whose eval-mode arguments
    draw none (a dropout off, attention without dropout)."""
    return _drawing(nodes, eval_value_of)


def random_in_training(nodes: Iterable[Node]) -> list[Node]:
    """The calls that draw random numbers in training: as :func:`random_in_eval`, by the
    arguments the model passes in training (those the graph records)."""
    return _drawing(nodes, _training_value_of)


def _training_value_of(node: Node, name: str) -> Any:
    """The value ``node`` passes as its schema argument ``name`` as traced (in training)."""
    slot = argument_slot(node, name)
    if slot is None:
        return None
    return node.args[slot] if isinstance(slot, int) else node.kwargs[slot]


def _drawing(nodes: Iterable[Node], value_of: Callable[[Node, str], Any]) -> list[Node]:
    drawing = []
    for node in nodes:
        op = op_overload(node.target) if node.kind == "call" else None
        if op is None or torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        switches = [a.name for a in op._schema.arguments if a.name in _RANDOM_WHEN]
        if switches and not any(_RANDOM_WHEN[s](value_of(node, s)) for s in switches):
            continue
        drawing.append(node)
    return drawing
