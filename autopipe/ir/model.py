"""What a graph records about the model it was traced from (``Graph.model``): its class and
spec, how it was traced (on the meta device, with which blocks and unit depth), the value ranges
of its integer inputs, the modules that register its custom operators, its dynamic
dimensions, where its ``pipe_split()`` markers ask stages to begin, for a Hugging Face
``PreTrainedModel`` its configuration (and generation configuration), which a trained model's
``from_pretrained`` directory needs, and the example's arguments that hold no tensor, which
torch.export fixed to their values (batches must pass the same), and the configuration values a
Hugging Face model was traced with as ``transformers`` trains it (``use_cache=False``), and the
dimension that holds the batch of each input whose batch is not along dimension 0
(:mod:`autopipe.ir.batch_dims`).

Graphs traced from a model record every fact; the graphs of a ``torch.cond`` branch record the
class and source line, those of a custom autograd function the class alone. :class:`ModelFacts`
keeps which facts its record holds, so that ``to_json`` gives back the record it was read from.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checks import is_class_name, is_fqn, is_identifier, is_int, is_text, is_value_name, require
from ..errors import ArtifactError
from ..runtime.core.fields import FieldReader
from ..runtime.core.fixed_inputs import FixedInput, fixed_inputs_from_json

__all__ = ["DynamicSymbol", "ModelFacts"]

#: the record's keys, in the order a graph artefact writes them
_KEYS = (
    "class",
    "source",
    "on_meta",
    "input_ranges",
    "depth",
    "basic_blocks",
    "inline_blocks",
    "operators",
    "symbols",
    "huggingface",
    "split_markers",
    "fixed_inputs",
    "trace_settings",
    "batch_dims",
)

#: checks of the record's JSON values that the runtime's formats share
_READ = FieldReader(ArtifactError, "a graph's model record")


@dataclass(frozen=True)
class DynamicSymbol:
    """A dynamic dimension of the model's inputs: its bounds, the size the graph is planned for
    (its upper bound, or the example's size when it has none), and the ``(input, dimension)``
    pairs it sizes."""

    min: int
    max: int | None
    planned: int
    sources: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "max": self.max,
            "planned": self.planned,
            "sources": [list(s) for s in self.sources],
        }

    @classmethod
    def from_json(cls, data: Any, name: str, where: str) -> DynamicSymbol:
        require(
            is_value_name(name)
            and isinstance(data, dict)
            and sorted(data) == ["max", "min", "planned", "sources"]
            and is_int(data["min"], 2)
            and is_int(data["planned"], data["min"])
            and (data["max"] is None or is_int(data["max"], data["planned"]))
            and isinstance(data["sources"], list)
            and all(
                isinstance(s, list) and len(s) == 2 and is_identifier(s[0]) and is_int(s[1], 0)
                for s in data["sources"]
            ),
            f"{where}model.symbols.{name}",
            data,
            "a dynamic dimension {min >= 2, planned >= min, max >= planned or null, "
            "sources: [[input, dimension], ...]}",
        )
        return cls(
            data["min"], data["max"], data["planned"], tuple((s, d) for s, d in data["sources"])
        )


@dataclass(frozen=True)
class ModelFacts:
    """The facts a graph records about its model; see the module docstring."""

    #: module and qualified name of the model's class (``"transformers....GPT2LMHeadModel"``)
    cls: str
    #: the model spec it was built from (``autopipe trace``), the ``FILE:LINE`` of a cond branch
    source: str | None = None
    #: traced on the meta device (no weights)
    on_meta: bool = False
    #: the largest value of each integer input, by name (embedding lookups are profiled in range)
    input_ranges: Mapping[str, int] = field(default_factory=dict)
    #: the module depth units were grouped at (None: automatic)
    depth: int | None = None
    #: the classes given as ``--basic-blocks``
    basic_blocks: tuple[str, ...] = ()
    #: whether stages inline blocks instead of holding them as submodules
    inline_blocks: bool = False
    #: the module that registers each custom operator (``namespace::name``) the graph calls
    operators: Mapping[str, str] = field(default_factory=dict)
    #: the dynamic dimensions, by name
    symbols: Mapping[str, DynamicSymbol] = field(default_factory=dict)
    #: a Hugging Face model's ``{"config": ..., "generation_config": ...}`` (the second may be
    #: absent), as ``save_pretrained`` writes them, and a PEFT model's ``"adapter"``; None for
    #: other models
    huggingface: Mapping[str, Any] | None = None
    #: the first call node after each of the model's ``pipe_split()`` markers (torch's
    #: pipelining's requested stage boundaries), in program order
    split_markers: tuple[str, ...] = ()
    #: the example's forward arguments that hold no tensor, which torch.export fixed to their
    #: values (runtime/core/fixed_inputs.py), by name
    fixed_inputs: Mapping[str, FixedInput] = field(default_factory=dict)
    #: configuration attributes of a Hugging Face model set for the trace as ``transformers``
    #: trains (``{"use_cache": False}``), with the values traced with; the model keeps its own
    trace_settings: Mapping[str, Any] = field(default_factory=dict)
    #: the dimension holding the batch of each input that does not hold it along dimension 0
    #: (found by the trace or given by ``--batch-dims``), by name
    batch_dims: Mapping[str, int] = field(default_factory=dict)
    #: the keys the record holds (a branch's or a function's graph records fewer facts)
    keys: frozenset[str] = frozenset(_KEYS[:8])

    @classmethod
    def of_subgraph(cls, class_name: str, source: str | None = None) -> ModelFacts:
        """The facts of a graph traced from part of a model (a ``torch.cond`` branch, a custom
        autograd function): its class, and the source line when there is one."""
        keys = {"class"} | ({"source"} if source is not None else set())
        return cls(cls=class_name, source=source, keys=frozenset(keys))

    def planned_sizes(self) -> dict[str, int]:
        """The size each dynamic dimension is planned for, by name."""
        return {name: s.planned for name, s in self.symbols.items()}

    def symbols_json(self) -> dict[str, dict[str, Any]]:
        """The dynamic dimensions as the graph artefact (and ``pipeline.json``) write them."""
        return {name: s.to_json() for name, s in self.symbols.items()}

    def updated(self, **changes: Any) -> ModelFacts:
        """A copy with some facts changed (by field name); the changed facts are recorded."""
        names = {"cls": "class"}
        keys = self.keys | {names.get(k, k) for k in changes}
        return ModelFacts(**{**self._fields(), **changes, "keys": frozenset(keys)})

    def _fields(self) -> dict[str, Any]:
        return {
            "cls": self.cls,
            "source": self.source,
            "on_meta": self.on_meta,
            "input_ranges": self.input_ranges,
            "depth": self.depth,
            "basic_blocks": self.basic_blocks,
            "inline_blocks": self.inline_blocks,
            "operators": self.operators,
            "symbols": self.symbols,
            "huggingface": self.huggingface,
            "split_markers": self.split_markers,
            "fixed_inputs": self.fixed_inputs,
            "trace_settings": self.trace_settings,
            "batch_dims": self.batch_dims,
        }

    def to_json(self) -> dict[str, Any]:
        values = {
            "class": self.cls,
            "source": self.source,
            "on_meta": self.on_meta,
            "input_ranges": dict(self.input_ranges),
            "depth": self.depth,
            "basic_blocks": list(self.basic_blocks),
            "inline_blocks": self.inline_blocks,
            "operators": dict(self.operators),
            "symbols": self.symbols_json(),
            "huggingface": self.huggingface,
            "split_markers": list(self.split_markers),
            "fixed_inputs": {name: f.to_json() for name, f in self.fixed_inputs.items()},
            "trace_settings": dict(self.trace_settings),
            "batch_dims": dict(self.batch_dims),
        }
        optional = {
            "symbols": bool(self.symbols),
            "huggingface": self.huggingface is not None,
            "split_markers": bool(self.split_markers),
            "fixed_inputs": bool(self.fixed_inputs),
            "trace_settings": bool(self.trace_settings),
            "batch_dims": bool(self.batch_dims),
        }
        return {key: values[key] for key in _KEYS if key in self.keys or optional.get(key)}

    def lint(self, where: str) -> None:
        """Check the facts as :meth:`from_json` checks a record (a graph built in memory)."""
        ModelFacts.from_json(self.to_json(), where)

    @classmethod
    def from_json(cls, model: Any, where: str) -> ModelFacts:
        """The facts a graph artefact's ``model`` record holds, checked; importing the modules
        that register its custom operators. ``where`` prefixes the field names of errors."""
        require(isinstance(model, dict), f"{where}model", model, "an object")
        unknown = sorted(set(model) - set(_KEYS))
        require(not unknown, f"{where}model", unknown, f"an object with the keys {list(_KEYS)}")
        require(
            is_class_name(model.get("class")), f"{where}model.class", model.get("class"), "a class"
        )
        source = model.get("source")
        require(source is None or is_text(source), f"{where}model.source", source, "a model spec")
        on_meta = model.get("on_meta", False)
        require(isinstance(on_meta, bool), f"{where}model.on_meta", on_meta, "true or false")
        ranges = model.get("input_ranges", {})
        require(
            isinstance(ranges, dict) and all(is_int(v) for v in ranges.values()),
            f"{where}model.input_ranges",
            ranges,
            "an object of integers by input name",
        )
        depth = model.get("depth")
        require(depth is None or is_int(depth, 0), f"{where}model.depth", depth, "null or a depth")
        blocks = model.get("basic_blocks", [])
        require(
            isinstance(blocks, list) and all(map(is_text, blocks)),
            f"{where}model.basic_blocks",
            blocks,
            "a list of class names",
        )
        inline = model.get("inline_blocks", False)
        require(isinstance(inline, bool), f"{where}model.inline_blocks", inline, "true or false")
        operators = model.get("operators", {})
        require(
            isinstance(operators, dict)
            and all(
                is_text(name) and name.count("::") == 1 and is_fqn(module)
                for name, module in operators.items()
            ),
            f"{where}model.operators",
            operators,
            "an object of module names by operator (namespace::name)",
        )
        symbols = model.get("symbols", {})
        require(isinstance(symbols, dict), f"{where}model.symbols", symbols, "an object")
        dims = {name: DynamicSymbol.from_json(s, name, where) for name, s in symbols.items()}
        huggingface = model.get("huggingface")
        require(
            huggingface is None
            or (
                isinstance(huggingface, dict)
                and isinstance(huggingface.get("config"), dict)
                and set(huggingface) <= {"config", "generation_config", "adapter"}
                and isinstance(huggingface.get("generation_config", {}), dict)
                and isinstance(huggingface.get("adapter", {}), dict)
            ),
            f"{where}model.huggingface",
            huggingface,
            "null or {config: {...}, generation_config: {...}, adapter: {...}} (a Hugging Face "
            "model's)",
        )
        markers = model.get("split_markers", [])
        require(
            isinstance(markers, list)
            and all(map(is_value_name, markers))
            and len(set(markers)) == len(markers),
            f"{where}model.split_markers",
            markers,
            "a list of distinct node names (the first call after each pipe_split() marker)",
        )
        fixed = fixed_inputs_from_json(
            model.get("fixed_inputs", {}), f"{where}model.fixed_inputs", _READ
        )
        settings = model.get("trace_settings", {})
        require(
            isinstance(settings, dict)
            and all(
                is_identifier(k) and (v is None or isinstance(v, (bool, int, float, str)))
                for k, v in settings.items()
            ),
            f"{where}model.trace_settings",
            settings,
            "an object of configuration values by attribute name",
        )
        batch_dims = model.get("batch_dims", {})
        require(
            isinstance(batch_dims, dict)
            and all(is_identifier(k) and is_int(v, 1) for k, v in batch_dims.items()),
            f"{where}model.batch_dims",
            batch_dims,
            "an object of dimensions (1 or more) by input name",
        )

        for name, module in sorted(operators.items()):  # registers them, for the graph's lint
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ArtifactError(
                    f"the graph calls the operator {name}, registered by the module {module}, "
                    f"which cannot be imported here ({exc}); install the package that provides it"
                ) from None
        return cls(
            cls=model["class"],
            source=source,
            on_meta=on_meta,
            input_ranges=dict(ranges),
            depth=depth,
            basic_blocks=tuple(blocks),
            inline_blocks=inline,
            operators=dict(operators),
            symbols=dims,
            huggingface=huggingface,
            split_markers=tuple(markers),
            fixed_inputs=fixed,
            trace_settings=dict(settings),
            batch_dims=dict(batch_dims),
            keys=frozenset(model),
        )
