"""Keep torch modules whole while ``torch.export`` traces a model.

Export cannot trace an RNN (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) over a ``PackedSequence``: the
packed data has as many rows as the batch has tokens, a size only the lengths' values give, and
the RNN's own code reads sizes from it. So while tracing:

- packing (``torch._VF._pack_padded_sequence``, which ``pack_padded_sequence`` calls after
  sorting the batch, whatever name the model imported it under) records the padded tensor and its
  lengths and returns stand-ins for the packed data and batch sizes (the operator
  ``autopipe.packed_sequence``, their sizes from the lengths' values; removed from the graph once
  traced, and a model that reads them itself is refused at that line);
- an RNN given such a ``PackedSequence`` becomes one ``autopipe.module`` call
  (:mod:`autopipe.ir.kept_module`) on the padded tensor, lengths, sorting permutation and
  hidden state, whose output is again a packed sequence held as its padded tensor;
- unpacking (``torch._VF._pad_packed_sequence``) reads the padded tensor back: to
  ``total_length`` when the model gives one, else to the batch's longest sequence, a size from
  tensor values that autopipe specialises to the example's and checks at run time.

An RNN given a tensor with a dynamic size (``--dynamic``) is kept as one call too: torch's RNN
kernels walk the sequence step by step, which would fix its length to the example's; the call's
results get their shapes from the input's (:func:`autopipe.ir.kept_module.rnn_results_like`).
Such a call, and one of an RNN named by ``--keep-whole``, passes the initial state as the RNN
takes it (an LSTM's as a pair).

A module the user names (``--keep-whole PATH``) is kept as one call however it is called, if it is
one of ``torch.nn``'s own classes with tensor (or None) arguments and tensor results.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..errors import TraceError
from ..ir.kept_module import (
    CallSpec,
    ModuleSpec,
    constructor_signature,
    has_symbolic_sizes,
    is_argument_value,
)
from ..runtime.core.kept_modules import has_values, tensors_of
from .autograd_function import outside_export
from .user_line import at_node, on_stack

__all__ = ["KeptModules", "module_spec", "modules_kept_whole", "remove_packed_stand_ins"]

#: constructor arguments that say whether a parameter exists: read back from the module
_FLAG_PARAMETERS = ("bias", "affine", "elementwise_affine")
_RNN_CLASSES = (nn.RNN, nn.LSTM, nn.GRU)


def _stand_ins(
    padded: torch.Tensor, lengths: torch.Tensor, batch_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """With values: empty tensors of the packed data's and batch sizes' real shapes."""
    rows, steps = int(lengths.sum()), int(lengths.max())
    return padded.new_empty((rows, *padded.shape[2:])), lengths.new_empty((steps,))


@torch.library.custom_op("autopipe::packed_sequence", mutates_args=())
def _packed_sequence(
    padded: torch.Tensor, lengths: torch.Tensor, batch_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands for the packed data and batch sizes of a sequence while tracing: their sizes (the
    tokens of the batch, its longest sequence) are values of the lengths, so a model that reads
    them computes on sizes from tensor values, which the converter then sees. Removed from the
    graph once traced; a model that reads them is refused."""
    return _stand_ins(padded, lengths, batch_first)


@_packed_sequence.register_fake
def _packed_sequence_fake(
    padded: torch.Tensor, lengths: torch.Tensor, batch_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    steps, batch = (padded.size(1), padded.size(0)) if batch_first else padded.shape[:2]
    context = torch.library.get_ctx()
    rows = context.new_dynamic_size(min=1, max=batch * steps)
    longest = context.new_dynamic_size(min=1, max=steps)
    return padded.new_empty((rows, *padded.shape[2:])), lengths.new_empty((longest,))


_STAND_IN = torch.ops.autopipe.packed_sequence.default
#: what export compares a size with, to check its range
_COMPARISONS = (operator.ge, operator.le, operator.gt, operator.lt, operator.eq)


@dataclass(frozen=True)
class _Packed:
    """A packed sequence as autopipe carries it: the padded tensor, sorted by length (longest
    first) in the layout ``batch_first`` says, and its sorted lengths. ``zeroed``: whether the
    padded tensor holds zeros after each sequence's end (an RNN's output does; the batch a
    model packs holds whatever it was padded with)."""

    padded: torch.Tensor
    lengths: torch.Tensor
    batch_first: bool
    zeroed: bool = False


class KeptModules:
    """The packed sequences and kept modules met while tracing one model."""

    def __init__(self, model: nn.Module, named: tuple[str, ...]):
        self.paths: dict[int, str] = {}
        self.names: dict[int, list[str]] = {}  # every name of each module
        for name, module in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(module), name)
            self.names.setdefault(id(module), []).append(name)
        self.named = {path: _named_module(model, path) for path in named}
        self._packed: dict[int, _Packed] = {}
        self._alive: list[torch.Tensor] = []  # the stand-ins, kept so that their ids stay theirs
        self._specs: dict[str, ModuleSpec] = {}

    # -- packing ---------------------------------------------------------------------------------
    def pack(
        self, padded: torch.Tensor, lengths: torch.Tensor, batch_first: bool, zeroed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data, batch_sizes = _STAND_IN(padded, lengths, batch_first)
        self._packed[id(data)] = _Packed(padded, lengths, batch_first, zeroed)
        self._alive.append(data)
        return data, batch_sizes

    def pad(
        self,
        data: torch.Tensor,
        batch_sizes: torch.Tensor,
        batch_first: bool,
        padding_value: float,
        total_length: int,
        given: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = self._packed.get(id(data))
        if packed is None:
            raise _refused_here(
                "the model unpacks (pad_packed_sequence) a PackedSequence whose data it computed "
                "itself",
                "unpack what pack_padded_sequence or an nn.LSTM / nn.GRU / nn.RNN made",
            )
        padded = packed.padded
        if packed.batch_first != batch_first:
            padded = padded.transpose(0, 1)
        time = 1 if batch_first else 0
        steps = padded.size(time)
        if not given:
            # torch pads to the longest sequence of the batch: a size from the lengths' values
            total_length = int(packed.lengths.max().item())  # specialised to the example, checked
            torch._check(total_length <= steps)
        if total_length > steps:
            padding = [0, 0] * (padded.dim() - time - 1) + [0, total_length - steps]
            padded = torch.nn.functional.pad(padded, padding)
        elif total_length < steps:
            padded = padded.narrow(time, 0, total_length)
        if padding_value != 0 or not packed.zeroed:
            # what torch writes after each sequence's end
            positions = torch.arange(padded.size(time), device=padded.device)
            valid = positions.unsqueeze(0) < packed.lengths.to(padded.device).unsqueeze(1)
            if not batch_first:
                valid = valid.t()
            valid = valid.reshape(*valid.shape, *([1] * (padded.dim() - 2)))
            padded = torch.where(valid, padded, padding_value)
        return padded, packed.lengths

    # -- calls -----------------------------------------------------------------------------------
    def rnn_over_packed(
        self, rnn: nn.RNNBase, sequence: PackedSequence, hx: Any
    ) -> tuple[PackedSequence, Any]:
        path = self._path(rnn)
        packed = self._packed.get(id(sequence.data))
        if packed is None:
            raise _refused_here(
                f"{path} ({type(rnn).__name__}) is given a PackedSequence that "
                "pack_padded_sequence did not make in the model's forward (the model received "
                "it as an input, or computed its data itself)",
                "give forward the padded batch and its lengths and pack them there; apply "
                "element-wise operations (dropout) to the padded batch before packing it",
            )
        hidden = [] if hx is None else [hx] if isinstance(hx, torch.Tensor) else list(hx)
        lstm = isinstance(rnn, nn.LSTM)
        call = CallSpec(
            "packed",
            results=3 if lstm else 2,
            batch_first=packed.batch_first,
            sorted_indices=sequence.sorted_indices is not None,
            hidden=len(hidden),
        )
        indices = [] if sequence.sorted_indices is None else [sequence.sorted_indices]
        results = self._call(rnn, path, call, [packed.padded, packed.lengths, *indices, *hidden])
        data, batch_sizes = self.pack(results[0], packed.lengths, packed.batch_first, zeroed=True)
        output = PackedSequence(
            data, batch_sizes, sequence.sorted_indices, sequence.unsorted_indices
        )
        return output, (results[1], results[2]) if lstm else results[1]

    def named_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """A call of a module the user asked to keep whole."""
        path = self._path(module)
        if kwargs or not all(a is None or isinstance(a, torch.Tensor) for a in args):
            raise TraceError(
                f"--keep-whole {path}: the model calls it with "
                f"{_described(args, kwargs)}; a module kept whole takes tensors or None as "
                "positional arguments"
            )
        spec = self._spec(module, path)
        # the results' structure, from the module run on these (fake) tensors, unrecorded
        with outside_export(), torch.no_grad():
            structure = type(module).forward(module, *args)
        call = CallSpec(
            "call",
            results=len(_result_tensors(structure, path)),
            arguments=tuple(a is not None for a in args),
        )
        tensors = [a for a in args if a is not None]
        results = self._call(module, path, call, tensors, spec)
        return _rebuild(structure, iter(results))

    def rnn_call(self, rnn: nn.RNNBase, input: torch.Tensor, hx: Any) -> Any:
        """A call of an RNN over a tensor kept whole (named by --keep-whole, or given a dynamic
        length): its input, then its initial state's tensors."""
        path = self._path(rnn)
        hidden = [] if hx is None else [hx] if isinstance(hx, torch.Tensor) else list(hx)
        if not all(isinstance(h, torch.Tensor) for h in hidden):
            raise _refused_here(
                f"{path} ({type(rnn).__name__}) is given an initial state that is not tensors",
                "give it a tensor (an LSTM a pair of tensors) or None",
                because="autopipe keeps it whole as one call",
            )
        lstm = isinstance(rnn, nn.LSTM)
        call = CallSpec("rnn", results=3 if lstm else 2, hidden=len(hidden))
        out, *state = self._call(rnn, path, call, [input, *hidden])
        return out, (tuple(state) if lstm else state[0])

    def _call(
        self,
        module: nn.Module,
        path: str,
        call: CallSpec,
        tensors: list[torch.Tensor],
        spec: ModuleSpec | None = None,
    ) -> list[torch.Tensor]:
        names = self.names.get(id(module), [])
        if len(names) > 1:
            raise TraceError(
                f"{path} ({type(module).__name__}) is kept whole, but the model holds it under "
                f"{len(names)} names ({', '.join(names)}); a stage holds a kept module under "
                "one name: call it through one attribute, or build one module per name"
            )
        spec = spec or self._spec(module, path)
        params = [module.get_parameter(name) for name in spec.params]
        results: list[torch.Tensor] = torch.ops.autopipe.module.default(
            path, spec.to_text(), call.to_text(), [*tensors, *params]
        )
        return results

    def _path(self, module: nn.Module) -> str:
        path = self.paths.get(id(module))
        if not path:
            raise TraceError(
                f"the model calls a {type(module).__name__} that is not one of its submodules "
                "(or is the model itself); autopipe keeps only submodules whole: register it "
                "as an attribute of the model"
            )
        return path

    def _spec(self, module: nn.Module, path: str) -> ModuleSpec:
        if path not in self._specs:
            with outside_export():  # building it again on meta is not the model's code
                self._specs[path] = module_spec(module, path)
        return self._specs[path]


def _refused_here(
    what: str,
    advice: str,
    because: str = "autopipe carries a packed sequence as its padded tensor and lengths",
) -> TraceError:
    """A refusal at the user's line now being traced: ``what`` is wrong, ``because`` of how
    autopipe keeps it, and the ``advice``."""
    line = on_stack()
    where, code = (line.where, line.code_block) if line else ("the model's forward", "")
    return TraceError(f"{where}: {what}{code}\n{because}: {advice}")


def module_spec(module: nn.Module, path: str) -> ModuleSpec:
    """How to build ``module`` again from ``torch.nn``: its class and constructor arguments,
    checked by building it on the meta device and comparing."""
    cls = type(module)
    if getattr(nn, cls.__name__, None) is not cls:
        if isinstance(module, nn.RNNBase):
            advice = (
                f"an RNN over a packed sequence is kept whole as torch.nn's own class: make "
                f"{path} an nn.{_torch_base(cls)} (or call one from a module of your own)"
            )
        else:
            advice = "keep the torch.nn modules inside it whole instead, or make it traceable"
        raise TraceError(
            f"{path} is a {cls.__qualname__}, a class of the model's own; autopipe keeps only "
            f"torch.nn's own module classes whole (generated code depends on torch alone): "
            f"{advice}"
        )
    signature = constructor_signature(cls)
    if "device" not in signature.parameters and any(True for _ in module.parameters()):
        raise _unbuildable(
            path, cls, "its constructor takes no device argument (it is built on the meta device)"
        )
    if any(True for _ in module.buffers()):
        raise TraceError(
            f"{path} ({cls.__name__}) has buffers; autopipe keeps whole only modules whose "
            "state is parameters"
        )
    args: list[tuple[str, Any]] = []
    for name, parameter in signature.parameters.items():
        if name in ("self", "mode", "device", "dtype") or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        if name == "proj_size" and not isinstance(module, nn.LSTM):
            continue  # GRU and RNN refuse the argument
        value = getattr(module, name, inspect.Parameter.empty)
        if name in _FLAG_PARAMETERS and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        if value is inspect.Parameter.empty or isinstance(value, (torch.Tensor, nn.Module)):
            if parameter.default is inspect.Parameter.empty:
                raise _unbuildable(path, cls, f"its argument {name} is not an attribute")
            continue
        value = list(value) if isinstance(value, tuple) else value
        if not is_argument_value(value):
            raise _unbuildable(path, cls, f"its argument {name} is a {type(value).__name__}")
        args.append((name, value))
    if isinstance(module, nn.RNN) and module.nonlinearity != "tanh":
        args.append(("nonlinearity", module.nonlinearity))
    spec = ModuleSpec(
        cls.__name__,
        tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in args),
        tuple(name for name, _ in module.named_parameters()),
    )
    try:
        rebuilt = spec.build("meta")
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be rebuilt
        raise _unbuildable(path, cls, f"building it again fails ({exc})") from None
    state = lambda m: [(n, tuple(p.shape)) for n, p in m.named_parameters()]  # noqa: E731
    if state(rebuilt) != state(module) or rebuilt.extra_repr() != module.extra_repr():
        raise _unbuildable(
            path,
            cls,
            "building it so gives other parameters or settings (some constructor arguments are "
            "not kept as attributes of the same name)",
        )
    return spec


def _torch_base(cls: type) -> str:
    """The torch.nn class a user's class derives from."""
    return next(c.__name__ for c in cls.__mro__ if getattr(nn, c.__name__, None) is c)


def _unbuildable(path: str, cls: type, why: str) -> TraceError:
    return TraceError(
        f"{path} ({cls.__name__}) cannot be kept whole: autopipe rebuilds it from its "
        f"constructor's arguments read back from the module, and {why}"
    )


def _named_module(model: nn.Module, path: str) -> nn.Module:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise TraceError(
            f"--keep-whole {path}: the model has no submodule of that name (names are as in "
            "model.named_modules(): encoder.rnn)"
        ) from None
    if module is model:
        raise TraceError("--keep-whole names a submodule, not the model itself")
    module_spec(module, path)  # refused now, before tracing, if it cannot be kept
    return module


def _described(args: tuple, kwargs: dict) -> str:
    kinds = [type(a).__name__ for a in args] + [
        f"{k}={type(v).__name__}" for k, v in kwargs.items()
    ]
    return "(" + ", ".join(kinds) + ")"


def _result_tensors(value: Any, path: str) -> tuple[torch.Tensor, ...]:
    try:
        return tensors_of(value)
    except TypeError as exc:  # it names what the result holds besides tensors
        raise TraceError(f"--keep-whole {path}: {exc}") from None


def _rebuild(structure: Any, results: Iterator[torch.Tensor]) -> Any:
    """``structure`` (tensors in tuples, lists, named tuples) with ``results`` in its tensors'
    places."""
    if isinstance(structure, torch.Tensor):
        return next(results)
    items = [_rebuild(item, results) for item in structure]
    return type(structure)(*items) if hasattr(structure, "_fields") else type(structure)(items)


@contextlib.contextmanager
def modules_kept_whole(model: nn.Module, named: tuple[str, ...] = ()) -> Iterator[KeptModules]:
    """Within: packed sequences are carried as padded tensors, RNNs over them and the modules
    ``named`` are kept whole (see the module docstring)."""
    kept = KeptModules(model, named)
    vf = torch._VF
    pack, pad = vf._pack_padded_sequence, vf._pad_packed_sequence
    forwards = {cls: cls.forward for cls in _RNN_CLASSES}

    def pad_packed(data, batch_sizes, batch_first, padding_value, total_length):  # type: ignore[no-untyped-def]
        if has_values(data):
            return pad(data, batch_sizes, batch_first, padding_value, total_length)
        caller = sys._getframe(1)  # torch's pad_packed_sequence: did the model give a length?
        given = caller.f_code.co_name != "pad_packed_sequence" or (
            caller.f_locals.get("total_length") is not None
        )
        return kept.pad(data, batch_sizes, batch_first, padding_value, total_length, given)

    def rnn_forward(original):  # type: ignore[no-untyped-def]
        def forward(self, input, hx=None):  # type: ignore[no-untyped-def]
            if isinstance(input, PackedSequence) and id(self) in kept.paths:
                return kept.rnn_over_packed(self, input, hx)
            if (
                isinstance(input, torch.Tensor)
                and id(self) in kept.paths
                and has_symbolic_sizes([input])
            ):  # a dynamic length, which torch's kernels would fix: kept whole
                return kept.rnn_call(self, input, hx)
            return original(self, input, hx)

        return forward

    def pack_padded(padded, lengths, batch_first):  # type: ignore[no-untyped-def]
        if has_values(padded):  # a kept module run on real values (export propagates them)
            return pack(padded, lengths, batch_first)
        return kept.pack(padded, lengths, batch_first)

    # patching torch's functions and classes deliberately, for this trace (restored below)
    vf._pack_padded_sequence = pack_padded
    vf._pad_packed_sequence = pad_packed
    for cls, original in forwards.items():
        cls.forward = rnn_forward(original)  # type: ignore[method-assign]
    for module in kept.named.values():  # on the instance: it follows the module into copies
        if isinstance(module, nn.RNNBase):
            module.forward = lambda input, hx=None, _m=module: (
                kept.rnn_over_packed(_m, input, hx)
                if isinstance(input, PackedSequence)
                else kept.rnn_call(_m, input, hx)
            )
        else:
            module.forward = lambda *args, _m=module, **kwargs: kept.named_call(_m, args, kwargs)
    try:
        yield kept
    finally:
        vf._pack_padded_sequence, vf._pad_packed_sequence = pack, pad
        for cls, original in forwards.items():
            cls.forward = original  # type: ignore[method-assign]
        for module in kept.named.values():
            del module.forward


def remove_packed_stand_ins(exported: torch.export.ExportedProgram) -> None:
    """Take the stand-ins for packed data out of the exported graph, with the checks export adds
    of their sizes' ranges, refusing a model that reads them itself (``packed.data``,
    ``packed.batch_sizes``, their sizes)."""
    graph = exported.graph_module.graph
    for node in list(graph.nodes):
        if node.target is not _STAND_IN:
            continue
        for item in list(node.users):
            for reader in list(item.users):
                checks = _range_checks(reader)
                if checks is None:
                    own = [u for u in reader.users if u.target not in _COMPARISONS]
                    where, code = at_node(own[0] if own else reader)
                    raise TraceError(
                        f"{where}: the model reads the data or batch sizes of a PackedSequence "
                        f"itself{code}\nautopipe carries a packed sequence as its padded tensor "
                        "and lengths: compute on the padded tensor (pad_packed_sequence) instead"
                    )
                for check in checks:
                    graph.erase_node(check)
                graph.erase_node(reader)
            graph.erase_node(item)
        graph.erase_node(node)
    exported.graph_module.recompile()


def _range_checks(reader: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes of export's own checks of a stand-in's size range (``sym_size`` compared and
    asserted), leaves first, if that is all ``reader`` is for; else None."""
    if reader.target is not torch.ops.aten.sym_size.int:
        return None
    asserts: list[torch.fx.Node] = []
    comparisons: list[torch.fx.Node] = []
    for comparison in reader.users:
        if comparison.target not in _COMPARISONS:
            return None
        for check in comparison.users:
            if check.target is not torch.ops.aten._assert_scalar.default:
                return None
            asserts.append(check)
        comparisons.append(comparison)
    return asserts + comparisons
