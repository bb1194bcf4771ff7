"""The compile options, each declared once: a field of :class:`CompileOptions` with its help text
and its :class:`Rule`, from which the command line's arguments are built (the flag is the field's
name, ``--dp-shard`` for ``dp_shard``).

Each option is checked once, by its rule: :meth:`Rule.check` when the options are made (the
Python API and the command line alike, :class:`AutopipeError`), and :meth:`Rule.parse` when the
command line reads the option's text, where a wrong value is argparse's usage error (exit 2,
``argument --stages: must be ...``) saying the same rule.
"""

from __future__ import annotations

import argparse
import math
from abc import ABC, abstractmethod
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .checks import is_fqn, is_int, is_number, is_text
from .errors import AutopipeError
from .partitioning import DEFAULT_METHOD, METHODS
from .partitioning.cost import STATE_FACTOR
from .partitioning.split_points import SPLIT_POINTS_SYNTAX
from .profiling import PROFILE_MODES
from .profiling.devices import known_link
from .runtime.core.schedules import COMPILE_SCHEDULES
from .tracing.dynamic import parse_dynamic, dynamic_dims

__all__ = [
    "COUNT",
    "OPTIONS",
    "SEQUENCE_PARALLEL_MODES",
    "TOLERANCE",
    "BatchDims",
    "Choice",
    "ClassNames",
    "CompileOptions",
    "Count",
    "DynamicDims",
    "Flag",
    "Fraction",
    "Link",
    "Option",
    "Rule",
    "Sizes",
    "Tolerance",
    "FIELDS",
    "flag_of",
    "name_of",
]


#: ``--sequence-parallel`` -> what :func:`~autopipe.tensor_parallel.sharding_plan` is asked
SEQUENCE_PARALLEL_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def flag_of(name: str) -> str:
    """The command-line flag of option ``name``: ``--dp-shard`` for ``dp_shard``."""
    return "--" + name.replace("_", "-")


def name_of(flag: str) -> str:
    """The Python name of option ``flag``: ``dp_shard`` for ``--dp-shard``."""
    return flag.removeprefix("--").replace("-", "_")


class Rule(ABC):
    """What the values of an option must be: :meth:`check` for a value given in Python,
    :meth:`parse` for the text given on the command line."""

    #: the values argparse offers and checks itself (``invalid choice``), if any
    choices: tuple[str, ...] | None = None

    @abstractmethod
    def check(self, value: Any, flag: str) -> Any:
        """``value`` as the options keep it; an :class:`AutopipeError` naming ``flag`` if it is
        not a value of this rule."""

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for on the command line (the text itself, unless a rule says
        otherwise); an :class:`argparse.ArgumentTypeError` if it stands for none."""
        return text


@dataclass(frozen=True)
class Count(Rule):
    """An option that counts something (``--stages``): an integer of at least ``minimum``."""

    minimum: int = 1

    @property
    def rule(self) -> str:
        return f"must be an integer of at least {self.minimum}"

    def check(self, value: Any, flag: str) -> Any:
        if not is_int(value, self.minimum):
            raise AutopipeError(f"{flag} {self.rule}, got {value!r}")
        return value

    def parse(self, text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not is_int(value, self.minimum):
            raise argparse.ArgumentTypeError(f"{self.rule}, got {text!r}")
        return value


@dataclass(frozen=True)
class Tolerance(Rule):
    """A comparison tolerance (``--rtol``): a finite number of at least 0."""

    rule = "must be a finite number of at least 0"

    @staticmethod
    def holds(value: Any) -> bool:
        return is_number(value, 0)

    def check(self, value: Any, flag: str) -> Any:
        if not self.holds(value):
            raise AutopipeError(f"{flag} {self.rule}, got {value!r}")
        return value

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not self.holds(value):
            raise argparse.ArgumentTypeError(f"{self.rule}, got {text!r}")
        return value


@dataclass(frozen=True)
class Seconds(Tolerance):
    """A time budget (``--search-seconds``): a finite number of seconds greater than 0."""

    rule = "must be a number of seconds greater than 0"

    @staticmethod
    def holds(value: Any) -> bool:
        return is_number(value, 0) and value > 0


#: integers of at least 1 (``--top``)
COUNT = Count(1)
#: comparison tolerances (``--rtol``, ``--atol``)
TOLERANCE = Tolerance()


@dataclass(frozen=True)
class Fraction(Rule):
    """A fraction of something (``--memory-margin``, of memory): a number in [0, 1)."""

    of: str

    @staticmethod
    def holds(value: Any) -> bool:
        return isinstance(value, float | int) and 0 <= value < 1

    def check(self, value: Any, flag: str) -> Any:
        if not self.holds(value):
            raise AutopipeError(f"{flag} must be a fraction of {self.of} in [0, 1), got {value!r}")
        return value

    def parse(self, text: str) -> float:
        value = TOLERANCE.parse(text)
        if not self.holds(value):
            raise argparse.ArgumentTypeError(f"must be less than 1, got {text!r}")
        return value


@dataclass(frozen=True)
class SplitPointsText(Rule):
    """Where the user asks stages to begin (``--split-points``): ``markers`` or module names
    each with ``:begin`` or ``:end``, comma-separated."""

    rule = "must be 'markers' or module names each with :begin or :end, comma-separated"

    def check(self, value: Any, flag: str) -> Any:
        if not (isinstance(value, str) and SPLIT_POINTS_SYNTAX.fullmatch(value)):
            raise AutopipeError(f"{flag} {self.rule} (layers.4,layers.8:end), got {value!r}")
        return value

    def parse(self, text: str) -> str:
        if not SPLIT_POINTS_SYNTAX.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{self.rule} (layers.4,layers.8:end), got {text!r}")
        return text


@dataclass(frozen=True)
class Choice(Rule):
    """One of a list of names (``--method``); on the command line, argparse's choices."""

    choices: tuple[str, ...]

    def check(self, value: Any, flag: str) -> Any:
        if value not in self.choices:
            raise AutopipeError(
                f"{flag} {value!r} is unknown; choose one of {', '.join(self.choices)}"
            )
        return value


@dataclass(frozen=True)
class ClassNames(Rule):
    """Module class names (``--basic-blocks GPT2Block,T5Block``): a tuple of names."""

    def check(self, value: Any, flag: str) -> Any:
        if isinstance(value, str) or not all(map(is_text, value)):
            raise AutopipeError(f"{name_of(flag)} must be a tuple of class names, got {value!r}")
        return value

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(c for c in text.split(",") if c)


@dataclass(frozen=True)
class ModuleNames(Rule):
    """Names of submodules as ``named_modules()`` gives them (``--keep-whole encoder.rnn``): a
    tuple of names."""

    def check(self, value: Any, flag: str) -> Any:
        if isinstance(value, str) or not all(is_fqn(v) for v in value):
            raise AutopipeError(
                f"{name_of(flag)} must be a tuple of module names (encoder.rnn), got {value!r}"
            )
        return value

    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(c for c in text.split(",") if c)


@dataclass(frozen=True)
class Flag(Rule):
    """A switch (``--inline-blocks``): True or False."""

    def check(self, value: Any, flag: str) -> Any:
        if not isinstance(value, bool):
            raise AutopipeError(f"{name_of(flag)} must be True or False, got {value!r}")
        return value


@dataclass(frozen=True)
class DynamicDims(Rule):
    """Dimensions that change from batch to batch: ``--dynamic`` declarations (see
    :mod:`autopipe.tracing.dynamic`), kept as a tuple of :class:`DynamicDim`."""

    def check(self, value: Any, flag: str) -> Any:
        return dynamic_dims(value)

    def parse(self, text: str) -> Any:
        try:
            return parse_dynamic(text)
        except AutopipeError as exc:
            message = str(exc).removeprefix(f"{flag_of('dynamic')} {text!r} ")
            raise argparse.ArgumentTypeError(message) from None


@dataclass(frozen=True)
class Sizes(Rule):
    """Sizes of dynamic dimensions by name (``--expected seq=512``): each at least 2."""

    def check(self, value: Any, flag: str) -> Any:
        sizes = value or {}
        if not (
            isinstance(sizes, dict)
            and all(is_text(k) and isinstance(v, int) and v >= 2 for k, v in sizes.items())
        ):
            raise AutopipeError(
                f"{name_of(flag)} must give sizes of dynamic dimensions by name, as in "
                f'{{"seq": 512}}; got {value!r}'
            )
        return value

    def parse(self, text: str) -> dict[str, int]:
        sizes = {}
        for item in text.split(","):
            name, _, size = item.partition("=")
            if not name.strip().isidentifier() or not size.strip().isdigit():
                raise argparse.ArgumentTypeError(f"{item!r} must be NAME=SIZE, e.g. seq=512")
            sizes[name.strip()] = int(size)
        return sizes


@dataclass(frozen=True)
class BatchDims(Rule):
    """The dimension holding the batch of some model inputs, by name (``--batch-dims h0=1,x=1``):
    each a dimension index of at least 0; the names are checked against the model's inputs when
    it is traced (:func:`autopipe.ir.batch_dims.batch_dims_of`)."""

    rule = "must give input dimensions by name, as in h0=1,x=1"

    def check(self, value: Any, flag: str) -> Any:
        dims = value or {}
        if not (
            isinstance(dims, dict)
            and all(is_text(k) and k.isidentifier() and is_int(v, 0) for k, v in dims.items())
        ):
            raise AutopipeError(f'{flag} {self.rule} ({{"h0": 1, "x": 1}}); got {value!r}')
        return dims

    def parse(self, text: str) -> dict[str, int]:
        dims: dict[str, int] = {}
        for item in text.split(","):
            name, _, dim = (part.strip() for part in item.partition("="))
            if not name.isidentifier() or not dim.isdigit():
                raise argparse.ArgumentTypeError(
                    f"{item!r} must be NAME=DIM (an input's name and the index of the dimension "
                    "that holds its batch), e.g. h0=1"
                )
            if name in dims:
                raise argparse.ArgumentTypeError(f"input {name!r} is given twice")
            dims[name] = int(dim)
        return dims


@dataclass(frozen=True)
class Link(Rule):
    """A link (``--link``, ``--network``): a known link name or a bandwidth in GB/s greater
    than 0."""

    flag: str = "--link"

    def check(self, value: Any, flag: str) -> Any:
        known_link(value, flag)
        return value

    def parse(self, text: str) -> str:
        try:
            known_link(text, self.flag)
        except AutopipeError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{self.flag} ")) from None
        return text


@dataclass(frozen=True)
class Option:
    """How a compile option is given on the command line, besides its flag: its help text,
    the rule its values follow, and argparse's ``metavar`` and ``action``."""

    help: str
    rule: Rule | None = None
    metavar: str | None = None
    action: str | None = None  # "store_true" or "append"

    def arguments(self) -> dict[str, Any]:
        """``ArgumentParser.add_argument``'s keywords for this option: its value is None when it
        is not given, and :class:`CompileOptions` has the default."""
        arguments: dict[str, Any] = {"help": self.help, "default": None}
        if self.action is not None:
            arguments["action"] = self.action
        if self.metavar is not None:
            arguments["metavar"] = self.metavar
        if self.rule is not None and self.rule.choices is not None:
            arguments["choices"] = self.rule.choices
        elif self.rule is not None and self.action != "store_true":
            arguments["type"] = self.rule.parse
        return arguments


def option(
    default: Any = MISSING,
    *,
    help: str,
    rule: Rule | None = None,
    metavar: str | None = None,
    action: str | None = None,
) -> Any:
    """A field of :class:`CompileOptions`: its default and its :class:`Option`."""
    return field(default=default, metadata={"option": Option(help, rule, metavar, action)})


@dataclass(frozen=True)
class CompileOptions:
    """Everything that decides the compiled pipeline besides the model."""

    stages: int = option(help="number of pipeline stages", rule=Count(1))
    #: default: one stage per device
    devices: int | None = option(
        None,
        help="number of devices (ranks); fewer than --stages puts several stages on a device "
        "(default: one stage per device)",
        rule=Count(1),
    )
    profile: str = option(
        "analytic",
        help="analytic (default, deterministic) or measured on this machine",
        rule=Choice(PROFILE_MODES),
    )
    method: str = option(
        DEFAULT_METHOD,
        help=f"partitioning method (default {DEFAULT_METHOD})",
        rule=Choice(tuple(sorted(METHODS))),
    )
    #: stage boundaries the user asks for (None: the method chooses them)
    split_points: str | None = option(
        None,
        help="begin the stages where the model's pipe_split() calls are ('markers') or at "
        "modules' beginnings or ends (torch's split_spec as text: layers.4,layers.8:end) "
        "instead of where the method would; without it, a model's markers are compared with "
        "the method's split in the summary",
        rule=SplitPointsText(),
        metavar="markers|MODULE[:end],...",
    )
    depth: int | None = option(
        None,
        help="group operators by module scope down to this depth (default: every module)",
        rule=Count(0),
    )
    basic_blocks: tuple[str, ...] = option(
        (),
        help="module classes kept whole in one unit (e.g. GPT2Block)",
        rule=ClassNames(),
        metavar="CLASS,...",
    )
    keep_whole: tuple[str, ...] = option(
        (),
        help="torch.nn submodules generated code calls whole, by name (e.g. encoder.rnn): for "
        "a module torch.export cannot trace; RNNs over packed sequences are kept whole anyway",
        rule=ModuleNames(),
        metavar="MODULE,...",
    )
    #: no block submodules: every operator in the stage's forward
    inline_blocks: bool = option(
        False,
        help="generate every operator inline in the stages' forward, with no block submodules",
        rule=Flag(),
        action="store_true",
    )
    #: dimensions that change from batch to batch: ``--dynamic`` texts, DynamicDims, or
    #: ``{"seq": [("input_ids", 1), ("labels", 1)]}`` (see autopipe/tracing/dynamic.py)
    dynamic: Any = option(
        (),
        help="a dimension that changes from batch to batch, traced as such: seq=input_ids:1,"
        "labels:1 (repeatable; from 2 and unbounded by default: planned at the example's size)",
        rule=DynamicDims(),
        metavar="NAME[MIN:MAX]=INPUT:DIM,...",
        action="append",
    )
    #: the dimension holding the batch of inputs that do not hold it along dimension 0, by name
    #: (default: dimension 0, or what the trace shows: an RNN's time-first input or its state)
    batch_dims: dict[str, int] | None = option(
        None,
        help="the dimension that holds the batch of an input whose batch is not the first "
        "dimension, e.g. h0=1,x=1 for a time-first RNN and its initial state (default 0, or "
        "what the trace shows: an input going straight into a torch RNN); the package "
        "records them, train.py splits batches along them",
        rule=BatchDims(),
        metavar="NAME=DIM[,NAME=DIM]",
    )
    #: sizes of dynamic dimensions to predict time at ({"seq": 512}; default: the planned sizes)
    expected: dict[str, int] | None = option(
        None,
        help="with --dynamic: the sizes to predict time at, e.g. seq=512 (default: the upper "
        "bounds, else the example's sizes; memory is always predicted at those)",
        rule=Sizes(),
        metavar="NAME=SIZE[,NAME=SIZE]",
    )
    #: plan for train.py --bf16: profile each unit's forward under bf16 autocast
    bf16: bool = option(
        False,
        help="plan for bf16 mixed precision (train.py --bf16, which the package then runs by "
        "default): each unit profiled under bfloat16 autocast over the fp32 parameters, its "
        "products timed at the device's bf16 rate and what they save in bf16; FSDP2 gathering "
        "bf16 parameters (default: the model's dtype)",
        rule=Flag(),
        action="store_true",
    )
    #: the hardware model: a table name or a JSON file (checked when it is read)
    device_spec: str | None = option(
        None,
        help="target device for the cost model (default h100): a table name, a JSON spec, or "
        "cpu / cuda for this machine's own (calibrated on first use, then cached)",
        metavar="NAME|FILE.json",
    )
    link: str | None = option(
        None,
        help="link between the GPUs of a node: nvlink4, pcie5, ... or a bandwidth in GB/s "
        "(default: the device spec's)",
        rule=Link(),
        metavar="NAME|GBPS",
    )
    network: str | None = option(
        None,
        help="each GPU's link to other nodes: ib-ndr (400 Gb/s), ib-xdr, roce-400g, "
        "ethernet-100g, ... or a bandwidth in GB/s (default: the device spec's)",
        rule=Link("--network"),
        metavar="NAME|GBPS",
    )
    #: default: 1f1b for one stage per device, auto otherwise
    schedule: str | None = option(
        None,
        help="schedule the partition is made for and train.py runs by default (default: 1f1b "
        "for one stage per device, auto otherwise)",
        rule=Choice(COMPILE_SCHEDULES),
    )
    microbatches: int | None = option(
        None,
        help="microbatches per step the cost model assumes (default 2 x stages)",
        rule=Count(1),
    )
    optimizer: str = option(
        "adamw",
        help="optimizer whose state the memory model counts (default adamw)",
        rule=Choice(tuple(STATE_FACTOR)),
    )
    #: data-parallel ranks each stage's training state is sharded over
    dp_shard: int = option(
        1,
        help="plan for each stage's parameters, gradients and optimizer state sharded over N "
        "data-parallel ranks (train.py --dp-shard N): 1/N of them per rank, plus the largest "
        "block gathered at a time (default 1)",
        rule=Count(1),
        metavar="N",
    )
    #: tensor-parallel degree: ranks each stage's attention and MLP regions are sharded over
    #: (None: 1, or with --search the degree the search chooses)
    tp: int | None = option(
        None,
        help="shard each stage's attention and MLP regions (found in the graph) over N ranks "
        "with torch's tensor parallelism; recorded in the package, whose train.py then runs "
        "pipeline ranks x --dp x --dp-shard x N processes, the N ranks of a stage on one node "
        "(default 1; with --search, the search tries 1, 2, 4 and 8 up to --gpus-per-node)",
        rule=Count(1),
        metavar="N",
    )
    #: with tensor parallelism: slice the values between regions along the sequence
    sequence_parallel: str = option(
        "auto",
        help="with --tp: run the code between tensor-parallel regions (norms, residual "
        "additions, dropout) on each rank's 1/N of the sequence, the regions' all-reduces "
        "becoming reduce-scatters and all-gathers: auto (default: where the graph allows it), "
        "on (refused, with the operator that prevents it, where it does not) or off",
        rule=Choice(tuple(SEQUENCE_PARALLEL_MODES)),
    )
    #: pipeline runs per optimizer step (train.py's default --accumulate)
    accumulate: int = option(
        1,
        help="pipeline runs per optimizer step train.py defaults to (default 1)",
        rule=Count(1),
        metavar="K",
    )
    #: search the whole plan for ``devices`` devices instead of taking the options above
    search: bool = option(
        False,
        help="search the plan for --devices devices (stages, placement, schedule, microbatches, "
        "accumulation, recomputation, --dp-shard) and generate the best; see `autopipe plan`",
        action="store_true",
    )
    #: with search: example microbatches per step (default 2 x devices)
    global_batch: int | None = option(
        None,
        help="example microbatches per optimizer step, over all data-parallel ranks: the "
        "search splits them into microbatches, accumulation and shards (default 2 x --devices)",
        rule=Count(1),
        metavar="B",
    )
    #: GPUs per node of the cluster: the network the plan is costed on, and the nodes the
    #: package's launch/slurm.sbatch asks for
    gpus_per_node: int = option(
        8,
        help="GPUs per node of the cluster: the plan costs traffic between nodes over each "
        "GPU's --network link and within a node over --link, and the package's "
        "launch/slurm.sbatch asks for as few nodes of that many GPUs as its processes fill "
        "(processes per node for a plan costed on a CPU; default 8)",
        rule=Count(1),
        metavar="G",
    )
    #: with search: the fraction of each device's memory left free
    memory_margin: float = option(
        0.1,
        help="fraction of each device's memory a plan leaves free (default 0.1)",
        rule=Fraction("memory"),
        metavar="F",
    )
    #: with search: the seconds it may take (None: every candidate is searched)
    search_seconds: float | None = option(
        None,
        help="stop the plan search after S seconds and take the best plan of the candidates "
        "searched by then, saying so (default: search every candidate)",
        rule=Seconds(),
        metavar="S",
    )
    #: with search: processes partitioning candidates at once (None: default_workers())
    search_workers: int | None = option(
        None,
        help="processes the plan search partitions candidates in at once, on Linux (default: "
        "the CPUs it may use, at most 8); the plans found are the same for any number",
        rule=Count(1),
        metavar="N",
    )
    #: with search: stages per device tried, 1 .. this
    max_stages_per_device: int = option(
        2,
        help="stages per device the search tries: 1 .. K (default 2)",
        rule=Count(1),
        metavar="K",
    )

    def __post_init__(self) -> None:
        """Check every option by its rule, so that a wrong one fails before the expensive steps
        (in this order, which decides the message when several are wrong)."""
        self._check(
            "stages", "accumulate", "max_stages_per_device", "global_batch", "search_workers"
        )
        self._check("split_points")
        self._check("memory_margin", "search_seconds")
        if self.search and self.split_points is not None:
            raise AutopipeError(
                "--split-points fixes the stages and --search chooses them: use one of the two"
            )
        if self.search and self.devices is None:
            raise AutopipeError(
                "--search needs --devices: the number of devices to plan for (pipeline "
                "ranks x --dp-shard)"
            )
        self._check("devices")
        if not self.search and self.devices is not None and self.devices > self.stages:
            raise AutopipeError(
                f"--devices {self.devices} is more than --stages {self.stages}: every device "
                f"runs at least one stage; use at most {self.stages} devices or more stages"
            )
        self._check("microbatches", "dp_shard", "tp", "depth", "gpus_per_node")
        if self.search and self.tp is not None and self.devices and self.devices % self.tp:
            raise AutopipeError(
                f"--devices {self.devices} is not a multiple of --tp {self.tp}: each stage's "
                f"tensor-parallel ranks are {self.tp} devices; use a multiple of {self.tp}"
            )
        if self.tp is not None and self.tp > self.gpus_per_node:
            raise AutopipeError(
                f"--tp {self.tp} is more than --gpus-per-node {self.gpus_per_node}: the ranks a "
                "tensor-parallel region is sharded over exchange every layer's activations and "
                f"share a node; use --tp {self.gpus_per_node} or less"
            )
        self._check("profile", "method", "schedule", "optimizer", "sequence_parallel")
        if self.sequence_parallel == "on" and not self.search and (self.tp or 1) == 1:
            raise AutopipeError(
                "--sequence-parallel on slices the values between tensor-parallel regions, "
                "which --tp 1 has none of; give --tp N (N > 1), or --search to try the degrees"
            )
        self._check("basic_blocks", "keep_whole", "dynamic", "batch_dims", "expected")
        self._check("inline_blocks", "bf16", "link", "network")

    @property
    def sequence_parallel_asked(self) -> bool | None:
        """``--sequence-parallel`` as :func:`~autopipe.tensor_parallel.sharding_plan` takes
        it: None (auto), True (on) or False (off)."""
        return SEQUENCE_PARALLEL_MODES[self.sequence_parallel]

    def _check(self, *names: str) -> None:
        """Check options ``names`` by their rules (None passes where it is the default), keeping
        the value each rule returns."""
        for name in names:
            value, declared = getattr(self, name), FIELDS[name]
            if value is None and declared.default is None:
                continue
            rule = OPTIONS[name].rule
            assert rule is not None, f"option {name} has no rule to check"
            checked = rule.check(value, flag_of(name))
            if checked is not value:
                object.__setattr__(self, name, checked)


#: the fields of :class:`CompileOptions` by name
FIELDS = {declared.name: declared for declared in fields(CompileOptions)}
#: how each compile option is given on the command line, by name
OPTIONS: dict[str, Option] = {
    name: declared.metadata["option"] for name, declared in FIELDS.items()
}
