"""Generated code for torch modules kept whole (see ``autopipe/ir/kept_module.py``).

A stage holds each kept module as a real ``torch.nn`` instance at its original name, built on
the meta device in ``__init__`` and given the parameters ``build_state`` created under that name
(``keep_whole(self, "encoder.rnn", nn.LSTM(...))``); its forward calls it: an RNN over a packed
sequence through ``run_over_packed``, an RNN over a tensor or any other module directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..ir import MODULE_TARGET, Graph, Node, Ref
from ..ir.kept_module import CallSpec, ModuleSpec, constructor_arguments, kept_modules
from . import emit

__all__ = ["call_statement", "kept_constructors", "support_names"]


def kept_constructors(nodes: Iterable[Node]) -> list[tuple[str, str]]:
    """``(original name, constructor expression)`` of the kept modules ``nodes`` call, in order
    of first call."""
    return [(path, _constructor(spec)) for path, spec in kept_modules(nodes).items()]


def support_names(nodes: Iterable[Node]) -> list[str]:
    """The runtime.support helpers the calls among ``nodes`` need."""
    forms = {
        CallSpec.from_text(n.args[2], n.args[0]).form for n in nodes if n.target == MODULE_TARGET
    }
    names = ["keep_whole"] if forms else []
    if "packed" in forms:
        names.append("run_over_packed")
    if forms & {"call", "rnn"}:
        names.append("tensors_of")
    return names


def _constructor(spec: ModuleSpec) -> str:
    positional, named = constructor_arguments(spec)
    arguments = [repr(v) for v in positional] + [f"{k}={v!r}" for k, v in named]
    if spec.takes_device:
        arguments.append("device='meta'")
    return f"nn.{spec.cls}({', '.join(arguments)})"


def call_statement(
    graph: Graph, node: Node, ref: Callable[[Ref], str], indent: int, target: str
) -> list[str]:
    """``target = run_over_packed(self.encoder.rnn, ...)`` or ``target =
    tensors_of(self.encoder.conv(x, None))``, as black lays it out at ``indent`` spaces."""
    path, _, call_text, inputs = node.args
    call = CallSpec.from_text(call_text, path)
    module = emit.attribute_path(path)
    given = [ref(r) for r in inputs[: call.tensors]]
    if call.form == "packed":
        padded, lengths, *rest = given
        indices = rest.pop(0) if call.sorted_indices else "None"
        hidden = "None" if not rest else rest[0] if len(rest) == 1 else f"({', '.join(rest)})"
        args = [module, padded, lengths, indices, hidden, f"batch_first={call.batch_first}"]
        return emit.assignment(target, "run_over_packed", args, indent)
    if call.form == "rnn":  # the initial state as the RNN takes it: an LSTM's as a pair
        x, *state = given
        passed = [x] if not state else [x, state[0] if len(state) == 1 else f"({', '.join(state)})"]
        return emit.assignment(target, "tensors_of", [f"{module}({', '.join(passed)})"], indent)
    supplied = iter(given)
    arguments = [next(supplied) if tensor else "None" for tensor in call.arguments]
    return emit.assignment(target, "tensors_of", [f"{module}({', '.join(arguments)})"], indent)


emit.register_emitter(MODULE_TARGET, call_statement)
