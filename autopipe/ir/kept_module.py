"""A torch module kept whole in the graph IR: one call node standing for a ``torch.nn`` module
that ``torch.export`` cannot trace (an RNN over a packed sequence; a module the user names with
``--keep-whole``).

The node is ``autopipe.module.default(PATH, MODULE, CALL, [inputs])``:

- ``PATH`` is the module's name in the model (``encoder.rnn``); its parameters keep their names
  under it;
- ``MODULE`` (:class:`ModuleSpec`, as JSON text) is how to build it: its ``torch.nn`` class, the
  constructor's arguments and its parameters' names;
- ``CALL`` (:class:`CallSpec`, as JSON text) is how the model calls it: over a packed sequence
  (the padded tensor, lengths, sorting permutation and hidden state) or with tensor arguments;
- ``inputs`` are the call's tensors, then the module's parameters in ``MODULE``'s order, so that
  the graph knows what the call reads (partitioning, memory, gradients).

Its results are a tuple of tensors that ``getitem`` nodes unpack. The node is self-contained: two
calls of one module carry the same ``MODULE``. Generated stages hold a real instance at ``PATH``
and call it (``autopipe/codegen/kept_module.py``); :func:`run_call` runs the same code on a
module built on the meta device with the node's parameters swapped in
(:mod:`autopipe.runtime.core.kept_modules`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from ..checks import is_fqn, is_identifier, is_int, require
from ..errors import ArtifactError
from ..runtime.core.kept_modules import hidden_of, run_over_packed, tensors_of
from .interpreter import node_context, replace_devices
from .kinds import HigherOrderKind, register
from .node_graph import NodeGraph
from .types import MODULE_TARGET, Node, Ref, TensorMeta, map_refs

__all__ = [
    "MODULE_TARGET",
    "CallSpec",
    "KeptCalls",
    "ModuleSpec",
    "call_module",
    "constructor_arguments",
    "constructor_signature",
    "has_symbolic_sizes",
    "is_argument_value",
    "kept_calls",
    "kept_modules",
    "lint_call",
    "rnn_results_like",
    "run_call",
    "specs_of",
]

#: JSON values a constructor argument may take
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class ModuleSpec:
    """How to build a kept module: ``torch.nn.<cls>(**args)``, with ``params`` the names of its
    parameters in the order a call passes them."""

    cls: str
    args: tuple[tuple[str, Any], ...]
    params: tuple[str, ...]

    def module_class(self) -> type[nn.Module]:
        found = getattr(nn, self.cls, None)
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            raise ArtifactError(f"torch.nn has no module class {self.cls!r}")
        return found

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """A new instance on ``device`` (uninitialised values on the meta device); a class
        whose constructor takes no device holds no parameters (the trace checked it)."""
        if not self.takes_device:
            return self.module_class()(**dict(self.args))
        return self.module_class()(**dict(self.args), device=device)

    @property
    def takes_device(self) -> bool:
        """Whether the class's constructor takes a ``device`` argument."""
        return "device" in constructor_signature(self.module_class()).parameters

    def to_text(self) -> str:
        return json.dumps(
            {"class": self.cls, "args": dict(self.args), "params": list(self.params)},
            sort_keys=True,
        )

    @classmethod
    def from_text(cls, text: Any, where: str) -> ModuleSpec:
        data = _json_object(text, where, ("args", "class", "params"))
        args, name, params = data["args"], data["class"], data["params"]
        require(is_identifier(name), f"{where}.class", name, "the name of a torch.nn class")
        require(
            isinstance(args, dict)
            and all(is_identifier(k) and is_argument_value(v) for k, v in args.items()),
            f"{where}.args",
            args,
            "constructor arguments: names -> numbers, booleans, strings, null or lists of them",
        )
        require(
            isinstance(params, list) and all(is_fqn(p) for p in params),
            f"{where}.params",
            params,
            "a list of parameter names",
        )
        return cls(name, tuple((k, _tuple(v)) for k, v in args.items()), tuple(params))


@dataclass(frozen=True)
class CallSpec:
    """How the model calls a kept module.

    ``form`` "packed": an RNN over a packed sequence; the call's tensors are the padded tensor
    (``batch_first`` says its layout), its lengths, the sorting permutation when
    ``sorted_indices``, and ``hidden`` tensors of the initial state (0, 1, or 2 for an LSTM's h
    and c). ``form`` "rnn": an RNN over a tensor, then ``hidden`` tensors of its initial state
    (passed as the RNN takes them: an LSTM's as a pair). ``form`` "call": positional
    ``arguments``, each a tensor (True) or None (False). ``results`` counts the tensors it
    returns.
    """

    form: str
    results: int
    batch_first: bool = False
    sorted_indices: bool = False
    hidden: int = 0
    arguments: tuple[bool, ...] = ()

    @property
    def tensors(self) -> int:
        """How many of the node's inputs are the call's (the module's parameters follow)."""
        if self.form == "packed":
            return 2 + int(self.sorted_indices) + self.hidden
        if self.form == "rnn":
            return 1 + self.hidden
        return sum(self.arguments)

    def to_text(self) -> str:
        if self.form == "packed":
            data: dict[str, Any] = {
                "form": "packed",
                "batch_first": self.batch_first,
                "sorted_indices": self.sorted_indices,
                "hidden": self.hidden,
            }
        elif self.form == "rnn":
            data = {"form": "rnn", "hidden": self.hidden}
        else:
            data = {"form": "call", "arguments": list(self.arguments)}
        return json.dumps(data | {"results": self.results}, sort_keys=True)

    @classmethod
    def from_text(cls, text: Any, where: str) -> CallSpec:
        form = _json_object(text, where, None).get("form")
        if form == "packed":
            data = _json_object(
                text, where, ("batch_first", "form", "hidden", "results", "sorted_indices")
            )
            for flag in ("batch_first", "sorted_indices"):
                require(isinstance(data[flag], bool), f"{where}.{flag}", data[flag], "a boolean")
            require(data["hidden"] in (0, 1, 2), f"{where}.hidden", data["hidden"], "0, 1 or 2")
            spec = cls(
                "packed",
                data["results"],
                batch_first=data["batch_first"],
                sorted_indices=data["sorted_indices"],
                hidden=data["hidden"],
            )
        elif form == "rnn":
            data = _json_object(text, where, ("form", "hidden", "results"))
            require(data["hidden"] in (0, 1, 2), f"{where}.hidden", data["hidden"], "0, 1 or 2")
            spec = cls("rnn", data["results"], hidden=data["hidden"])
        else:
            require(form == "call", f"{where}.form", form, '"packed", "rnn" or "call"')
            data = _json_object(text, where, ("arguments", "form", "results"))
            arguments = data["arguments"]
            require(
                isinstance(arguments, list) and all(isinstance(a, bool) for a in arguments),
                f"{where}.arguments",
                arguments,
                "a list of booleans (a tensor argument or None)",
            )
            spec = cls("call", data["results"], arguments=tuple(arguments))
        require(is_int(spec.results, 1), f"{where}.results", spec.results, "a count of tensors")
        return spec


def _json_object(text: Any, where: str, keys: tuple[str, ...] | None) -> dict[str, Any]:
    try:
        data = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        data = None
    require(isinstance(data, dict), where, text, "the JSON text of an object")
    assert isinstance(data, dict)  # require raised otherwise
    if keys is not None:
        require(sorted(data) == sorted(keys), where, text, f"an object with the keys {list(keys)}")
    return data


def is_argument_value(value: Any) -> bool:
    """Whether a constructor argument can be written down: a number, boolean, string, None, or
    a list of them."""
    if isinstance(value, list):
        return all(is_argument_value(v) for v in value)
    return isinstance(value, _SCALARS)


def _tuple(value: Any) -> Any:
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


# -- the stand-in operator torch.export records -------------------------------------------------
@torch.library.custom_op("autopipe::module", mutates_args=())
def _module_op(path: str, module: str, call: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for a kept module while torch.export traces the model (with real values when the
    export propagates them); generated code calls the module itself."""
    return _traced_call(path, module, call, inputs)


@_module_op.register_fake
def _module_op_fake(
    path: str, module: str, call: str, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    spec, call_spec = specs_of(path, module, call)
    if call_spec.form == "rnn" and has_symbolic_sizes(inputs):  # (lint: an RNN's call)
        rnn = _template(spec)
        assert isinstance(rnn, nn.RNNBase)
        results = rnn_results_like(rnn, inputs[0])  # its kernels would fix a dynamic length
        assert len(results) == call_spec.results, "an RNN returns its output and state"
        return results
    return _traced_call(path, module, call, inputs)


def has_symbolic_sizes(tensors: list[torch.Tensor]) -> bool:
    """Whether any size of ``tensors`` is a symbol (torch.export's dynamic dimensions)."""
    return any(not isinstance(size, int) for t in tensors for size in t.shape)


def rnn_results_like(rnn: nn.RNNBase, x: torch.Tensor) -> list[torch.Tensor]:
    """Empty results of the shapes a call of ``rnn`` on the input ``x`` returns (its output,
    then its final state's tensors), without running its kernels: torch's RNN kernels walk the
    sequence step by step and would fix a dynamic length to the example's. The output keeps
    the input's leading sizes, its last is ``directions x (proj_size or hidden_size)`` (batch
    first: a transposed time-first tensor, strides as torch's kernels make it, so that the
    model's ``.contiguous()`` before a ``view`` is kept); each final state is ``(directions x
    layers, batch, size)`` (no batch for an unbatched input)."""
    directions = 2 if rnn.bidirectional else 1
    out_size = (rnn.proj_size or rnn.hidden_size) if isinstance(rnn, nn.LSTM) else rnn.hidden_size
    batch = [] if x.dim() == 2 else [x.shape[0] if rnn.batch_first else x.shape[1]]
    layers = directions * rnn.num_layers
    if rnn.batch_first and batch:  # computed time first and transposed, as torch's kernels do
        output = x.new_empty((x.shape[1], x.shape[0], directions * out_size)).transpose(0, 1)
    else:
        output = x.new_empty((*x.shape[:-1], directions * out_size))
    results = [output]
    results.append(x.new_empty((layers, *batch, out_size)))
    if isinstance(rnn, nn.LSTM):
        results.append(x.new_empty((layers, *batch, rnn.hidden_size)))
    return results


def _traced_call(
    path: str, module: str, call: str, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    return _fresh(call_module(*specs_of(path, module, call), inputs), inputs)


@lru_cache(maxsize=256)
def specs_of(path: str, module: str, call: str) -> tuple[ModuleSpec, CallSpec]:
    """A call's module and call specs read from their JSON texts (``where``: ``path``), once
    per text: the interpreter and the operator's kernels meet the same texts on every run."""
    return ModuleSpec.from_text(module, path), CallSpec.from_text(call, path)


def _fresh(results: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Results as a custom operator must return them: none of them an input."""
    return [t.clone() if any(t is i for i in inputs) else t for t in results]


# -- running a call ----------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _template(spec: ModuleSpec) -> nn.Module:
    """An instance on the meta device, whose parameters each call swaps for its own."""
    return spec.build("meta")


class _Call(nn.Module):
    """Runs one call of ``module`` (its parameters swapped in by ``functional_call``)."""

    def __init__(self, module: nn.Module, call: CallSpec):
        super().__init__()
        self.module = module
        self.call = call

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call = self.call
        if call.form == "packed":
            padded, lengths, *rest = tensors
            sorted_indices = rest.pop(0) if call.sorted_indices else None
            hidden = hidden_of(rest, call.hidden)
            assert isinstance(self.module, nn.RNNBase)  # lint: a packed call is an RNN's
            return run_over_packed(
                self.module, padded, lengths, sorted_indices, hidden, call.batch_first
            )
        if call.form == "rnn":
            return tensors_of(self.module(tensors[0], hidden_of(tensors[1:], call.hidden)))
        given = iter(tensors)
        return tensors_of(self.module(*(next(given) if a else None for a in call.arguments)))


def call_module(
    spec: ModuleSpec, call: CallSpec, inputs: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """One call of a kept module on the node's inputs (the call's tensors, then the module's
    parameters), as the generated stage makes it: gradients reach every input."""
    tensors, params = inputs[: call.tensors], inputs[call.tensors :]
    runner = _Call(_template(spec), call)
    state = {f"module.{name}": value for name, value in zip(spec.params, params)}
    results: tuple[torch.Tensor, ...] = torch.func.functional_call(runner, state, tuple(tensors))
    return results


def run_call(
    node: Node, env: Mapping[str, Any], device: torch.device, functions: Mapping[str, Any] | None
) -> Any:
    """The interpreter's hook: the call under the node's grad / autocast modes."""
    path, module, call, inputs = replace_devices(map_refs(node.args, lambda r: env[r.name]), device)
    spec, call_spec = specs_of(path, module, call)
    if node.context:
        with node_context(node.context, device):
            return call_module(spec, call_spec, inputs)
    return call_module(spec, call_spec, inputs)


# -- invariants ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeptCalls:
    """The calls of one kept module: its spec, the forms they take (``"packed"``, ``"rnn"``,
    ``"call"``) and the units they are in."""

    spec: ModuleSpec
    forms: frozenset[str]
    units: frozenset[int]


def kept_calls(nodes: Any) -> dict[str, KeptCalls]:
    """The kept modules ``nodes`` call and how, by path, in order of first call."""
    specs: dict[str, ModuleSpec] = {}
    forms: dict[str, set[str]] = {}
    units: dict[str, set[int]] = {}
    for node in nodes:
        if node.target != MODULE_TARGET:
            continue
        path = node.args[0]
        spec, call = specs_of(path, node.args[1], node.args[2])
        specs.setdefault(path, spec)
        forms.setdefault(path, set()).add(call.form)
        units.setdefault(path, set()).add(node.unit)
    return {
        path: KeptCalls(spec, frozenset(forms[path]), frozenset(units[path]))
        for path, spec in specs.items()
    }


def kept_modules(nodes: Any) -> dict[str, ModuleSpec]:
    """The kept modules ``nodes`` call, by path, in order of first call."""
    return {path: calls.spec for path, calls in kept_calls(nodes).items()}


def lint_call(graph: NodeGraph, node: Node, field_: str) -> None:
    """Check a call of a kept module: its path, module and call, and inputs whose parameters are
    the graph's parameters of those names."""
    args = list(node.args)
    require(
        len(args) == 4 and is_fqn(args[0]) and isinstance(args[3], list) and not node.kwargs,
        f"{field_}.args",
        args,
        "[a module's name, its module spec, its call spec, a list of tensor inputs]",
    )
    path, module, call, inputs = args
    spec = ModuleSpec.from_text(module, f"{field_}.args[1]")
    call_spec = CallSpec.from_text(call, f"{field_}.args[2]")
    try:
        template = _template(spec)
    except Exception as exc:  # noqa: BLE001 - whatever torch raises, the artefact is wrong
        raise ArtifactError(f"{field_}.args[1] does not build a module: {exc}") from None
    names = [name for name, _ in template.named_parameters()]
    require(
        list(spec.params) == names,
        f"{field_}.args[1].params",
        list(spec.params),
        f"the parameters torch.nn.{spec.cls} builds ({names})",
    )
    if call_spec.form in ("packed", "rnn"):
        lstm = isinstance(template, nn.LSTM)
        require(
            isinstance(template, nn.RNNBase),
            f"{field_}.args[2].form",
            call_spec.form,
            f"a call form its module takes ({call_spec.form}: an RNN's)",
        )
        require(
            call_spec.hidden in ((0, 2) if lstm else (0, 1)),
            f"{field_}.args[2].hidden",
            call_spec.hidden,
            f"the tensors of an initial state of torch.nn.{spec.cls} (0 or {2 if lstm else 1})",
        )
        require(
            call_spec.results == (3 if lstm else 2),
            f"{field_}.args[2].results",
            call_spec.results,
            "the output, then the final state's tensors",
        )
    require(
        len(inputs) == call_spec.tensors + len(spec.params)
        and all(isinstance(r, Ref) and isinstance(graph[r.name].meta, TensorMeta) for r in inputs),
        f"{field_}.args[3]",
        inputs,
        f"{call_spec.tensors} tensor(s) of the call, then the module's {len(spec.params)} "
        "parameter(s)",
    )
    for name, ref in zip(spec.params, inputs[call_spec.tensors :]):
        source = graph[ref.name]
        require(
            source.kind == "param" and source.target == f"{path}.{name}",
            f"{field_}.args[3]",
            ref.name,
            f"the parameter {path}.{name}",
        )
    meta = node.meta
    require(
        isinstance(meta, tuple) and len(meta) == call_spec.results,
        f"{field_}.meta",
        meta,
        f"the metadata of {call_spec.results} result tensor(s)",
    )


def _lint_modules(graph: NodeGraph, where: str) -> None:
    """Every call of one path builds the same module."""
    seen: dict[str, str] = {}
    for node in graph.nodes:
        if node.target == MODULE_TARGET and len(node.args) == 4:
            path, module = node.args[0], node.args[1]
            require(
                seen.setdefault(path, module) == module,
                f"{where}nodes ({node.name!r}).args[1]",
                module,
                f"the module the other calls of {path} build",
            )


def constructor_signature(cls: type[nn.Module]) -> inspect.Signature:
    """The constructor signature of a torch.nn class; an RNN's is ``nn.RNNBase``'s (``nn.LSTM``
    and its kin take ``*args, **kwargs`` and pass them on)."""
    return inspect.signature((nn.RNNBase if issubclass(cls, nn.RNNBase) else cls).__init__)


def constructor_arguments(spec: ModuleSpec) -> tuple[list[Any], list[tuple[str, Any]]]:
    """The constructor arguments worth writing, in the signature's order: the required ones
    (positional), then the others off their defaults (by name)."""
    cls = spec.module_class()
    signature = constructor_signature(cls)
    given = dict(spec.args)
    positional: list[Any] = []
    named: list[tuple[str, Any]] = []
    for name, parameter in signature.parameters.items():
        if name not in given:
            continue
        if parameter.default is inspect.Parameter.empty and not named:
            positional.append(given.pop(name))
        elif parameter.default is inspect.Parameter.empty or parameter.default != given[name]:
            named.append((name, given.pop(name)))
        else:
            given.pop(name)
    named.extend(given.items())  # not in the signature (nonlinearity of nn.RNN)
    return positional, named


register(
    HigherOrderKind(
        MODULE_TARGET,
        operator=torch.ops.autopipe.module.default,
        lint=lint_call,
        run=run_call,
        lint_graph=_lint_modules,
    )
)
