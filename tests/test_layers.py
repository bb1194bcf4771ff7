"""The package's structure, enforced: import directions between layers, no private names across
modules, no imports hidden inside functions, and a runtime that needs only torch.

docs/architecture.md draws the layers; this test is their definition. It walks every module's
imports (``ast``, nothing is imported), so a violation fails here with the edge that breaks it.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

from conftest import ROOT

PACKAGE = ROOT / "autopipe"

#: Layers from the bottom up: a module may import modules of its own layer's package and of lower
#: layers, never of a higher layer nor of another package in its own layer. The runtime is the
#: bottom: it is copied into every generated package, which needs only torch.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("autopipe.runtime",),
    ("autopipe.errors", "autopipe.templates"),
    ("autopipe.checks", "autopipe.artifacts"),
    ("autopipe.spec",),
    ("autopipe.ir",),
    ("autopipe.tracing", "autopipe.profiling", "autopipe.tensor_parallel"),
    ("autopipe.partitioning",),
    ("autopipe.codegen",),
    ("autopipe.report",),
    ("autopipe.options",),
    ("autopipe.compiler", "autopipe.verify"),
    ("autopipe.replan",),
    ("autopipe.cli",),
    ("autopipe.__main__", "autopipe"),
)
#: the part of the runtime the compiler shares with train.py; the rest is train.py's executor
RUNTIME_CORE = "autopipe.runtime.core"
#: layers that run generated packages and checkpoints, not only compile: may use the executor
EXECUTOR_USERS = ("autopipe.verify", "autopipe.cli")
#: modules that import a module of their own package when it is needed, to keep start-up quick
#: (the command line imports each command's modules when it runs; the report package imports
#: matplotlib's users only when a report is written): deferrals, not hidden cycles
LAZY_IMPORTS_ALLOWED = ("autopipe.cli", "autopipe.report")


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    target: str  # the imported module (or package)
    names: tuple[str, ...]  # names taken from it (empty for ``import x``)
    line: int
    in_function: bool

    def __str__(self) -> str:
        taken = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.importer}:{self.line} imports {self.target}{taken}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = package_modules()


def imports_of(name: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, the text of module ``name``, with relative ones resolved."""
    tree = ast.parse(source)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in MODULES:  # ``from . import module``
                        found.append(Import(name, submodule, (), child.lineno, inside))
                    else:
                        found.append(Import(name, target, (alias.name,), child.lineno, inside))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(name, alias.name, (), child.lineno, inside))
            visit(child, inside)

    visit(tree, False)
    return found


IMPORTS = [
    i
    for name, path in MODULES.items()
    for i in imports_of(name, path.read_text(encoding="utf-8"), path.name == "__init__.py")
]
INTERNAL = [i for i in IMPORTS if i.target == "autopipe" or i.target.startswith("autopipe.")]


def layer_of(module: str) -> tuple[int, str]:
    """The layer index of ``module`` and the layer member (package or module) it belongs to."""
    best: tuple[int, str] | None = None
    for index, members in enumerate(LAYERS):
        for member in members:
            if module == member or (member != "autopipe" and module.startswith(member + ".")):
                if best is None or len(member) > len(best[1]):
                    best = (index, member)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for edge in INTERNAL:
        low, member = layer_of(edge.importer)
        high, target_member = layer_of(edge.target)
        if edge.target == "autopipe":
            wrong.append(f"{edge}: the package's __init__ is the top; import the module itself")
        elif high > low or (high == low and member != target_member):
            wrong.append(f"{edge}: {target_member} is not below {member}")
    assert not wrong, "reverse layer edges:\n" + "\n".join(wrong)


def test_the_compiler_uses_only_the_runtime_core() -> None:
    wrong = [
        str(edge)
        for edge in INTERNAL
        if edge.target.startswith("autopipe.runtime")
        and not edge.importer.startswith("autopipe.runtime")
        and not edge.target.startswith(RUNTIME_CORE)
        and not edge.importer.startswith(EXECUTOR_USERS)
    ]
    assert not wrong, "the compiler imports the training executor:\n" + "\n".join(wrong)


def test_the_runtime_core_does_not_use_the_executor() -> None:
    wrong = [
        str(edge)
        for edge in INTERNAL
        if edge.importer.startswith(RUNTIME_CORE) and not edge.target.startswith(RUNTIME_CORE)
    ]
    assert not wrong, "\n".join(wrong)


def test_runtime_needs_only_torch_and_the_standard_library() -> None:
    runtime = [n for n in MODULES if n.startswith("autopipe.runtime")]
    assert len(runtime) > 5 and RUNTIME_CORE in runtime  # derived from the directory
    wrong = []
    for edge in IMPORTS:
        if not edge.importer.startswith("autopipe.runtime"):
            continue
        top = edge.target.split(".")[0]
        if edge.target.startswith("autopipe.runtime") or top == "torch":
            continue
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        wrong.append(str(edge))
    assert not wrong, "runtime modules import more than torch and the standard library:\n" + (
        "\n".join(wrong)
    )


def test_no_private_name_crosses_a_module_boundary() -> None:
    wrong = [
        str(edge)
        for edge in INTERNAL
        if any(n.startswith("_") and not n.startswith("__") for n in edge.names)
        or any(part.startswith("_") and part != "__main__" for part in edge.target.split("."))
    ]
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level
            for alias in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                wrong.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)


def test_no_imports_hidden_in_functions() -> None:
    wrong = [
        str(edge)
        for edge in INTERNAL
        if edge.in_function and not edge.importer.startswith(LAZY_IMPORTS_ALLOWED)
    ]
    assert not wrong, "imports inside functions (they hide import cycles):\n" + "\n".join(wrong)


#: the most modules ``autopipe/`` keeps at its top level: the rest live in the packages that use them
TOP_LEVEL_MODULES = 10
#: the most lines a subcommand's module of the command line may have (its parser and its run)
COMMAND_LINES = 120


def test_the_top_level_is_small() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"


def test_no_import_circle_within_a_package() -> None:
    """Modules of one package import each other in one direction, type-only imports included
    (``if TYPE_CHECKING:`` hides a circle from Python, not from a reader)."""
    imports = nx.DiGraph()
    for edge in INTERNAL:
        if edge.target not in MODULES or edge.target == edge.importer:
            continue
        # a package's __init__ gathers its modules: an edge into it is an edge to its face
        if MODULES[edge.target].name == "__init__.py" and edge.importer.startswith(
            edge.target + "."
        ):
            continue
        imports.add_edge(edge.importer, edge.target)
    try:
        circle = nx.find_cycle(imports)
    except nx.NetworkXNoCycle:
        return
    raise AssertionError(
        "import circle: " + " -> ".join(a for a, _ in circle) + f" -> {circle[0][0]}"
    )


def test_each_command_is_a_small_module() -> None:
    cli = PACKAGE / "cli"
    commands = [p for p in cli.glob("*.py") if p.name != "__init__.py"]
    assert len(commands) >= 10  # derived from the directory: one module per subcommand
    long = {
        p.name: n
        for p in [*commands, cli / "__init__.py"]
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > COMMAND_LINES
    }
    assert not long, f"command-line modules over {COMMAND_LINES} lines: {long}"


PLANTED = {
    "ir imports codegen": ("autopipe.ir.graph", "from ..codegen import emit\n"),
    "profiling imports tracing": ("autopipe.profiling.analytic", "from ..tracing import export\n"),
    "core imports the executor": ("autopipe.runtime.core.pipeline", "from ..driver import main\n"),
    "runtime imports numpy": ("autopipe.runtime.core.shapes", "import numpy\n"),
    "private name": ("autopipe.partitioning.cost", "from ..ir.graph import _private\n"),
    "import in a function": (
        "autopipe.partitioning.cost",
        "def f():\n    from ..errors import AutopipeError\n",
    ),
    "compiler imports the executor": ("autopipe.codegen.package", "from ..runtime import driver\n"),
}
RULES = (
    test_imports_point_down_the_layers,
    test_the_compiler_uses_only_the_runtime_core,
    test_the_runtime_core_does_not_use_the_executor,
    test_runtime_needs_only_torch_and_the_standard_library,
    test_no_private_name_crosses_a_module_boundary,
    test_no_imports_hidden_in_functions,
)


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_violation_fails(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind of violation, planted in the import table, fails at least one rule; the real
    table passes them all (the tests above)."""
    host, source = PLANTED[case]
    extra = imports_of(host, source)
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "IMPORTS", IMPORTS + extra)
    monkeypatch.setattr(
        module, "INTERNAL", INTERNAL + [i for i in extra if i.target.startswith("autopipe")]
    )
    failed = []
    for rule in RULES:
        try:
            rule()
        except AssertionError:
            failed.append(rule.__name__)
    assert failed, f"no rule caught: {case}"
