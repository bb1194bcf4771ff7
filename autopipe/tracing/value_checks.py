"""Checks on tensor values: a truth value read from tensors (``if x.sum() != n: raise ...``,
``assert``, ``torch._check_tensor_all``) whose other side only raises is the model checking its
input, not control flow. The graph follows the example's side and the stage checks, at run time,
that each batch takes it too, raising the model's own message when it does not.

A read is a check when the statement of the user's code that made it is one of

- ``assert cond, message``;
- ``if cond: raise E(message)`` (or its ``else`` alone raises): the side that only raises
  (simple statements may precede the ``raise``) is the one the example did not take;
- a call of a check function (``torch._check``, ``torch._check_tensor_all``, a library's own
  ``*check*`` wrapper): the message is its argument after the condition, found in the caller
  when the wrapper passes on its own parameter (transformers' ``torch_compilable_check``).

Anything else (work on both sides, a loop, a conditional expression) is control flow and stays
refused (tracing/values.py says what to do). The message is the model's: a string as written, an
f-string with its fields shown as in the source (``{n_tokens}``), since the values are the
failing batch's and only the stage has them.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from dataclasses import dataclass

from torch import fx

from ..runtime.core.errors import FAILED_MODEL_CHECK
from .user_line import UserLine, user_frames

__all__ = ["ValueCheck", "value_check"]

#: torch's check functions and the exception each raises
_TORCH_CHECKS = {
    "_check": "RuntimeError",
    "_check_tensor_all": "RuntimeError",
    "_check_value": "ValueError",
    "_check_index": "IndexError",
    "_check_type": "TypeError",
    "_check_not_implemented": "NotImplementedError",
    "_check_is_size": "RuntimeError",
}
#: keyword names a check function takes its message and its exception type by
_MESSAGE_KEYWORDS = ("msg", "message", "error_message")
_ERROR_KEYWORDS = ("error_type", "exc_type", "error", "exception")
#: the word "check" in a function's name, as a word of it
_CHECK_WORD = re.compile(r"(?:^|_)check(?:$|_)", re.IGNORECASE)


@dataclass(frozen=True)
class ValueCheck:
    """A check of the model on tensor values, where its user's line is (``where``,
    ``FILE:LINE``; ``code``, the statement's first line) and what it raises: the exception's
    name (``error``, empty when the source does not say) and the model's ``message``."""

    where: str
    code: str
    error: str
    message: str
    #: whether the check holds for one value read alone: its condition combines values so that
    #: a second one read in it could change without the model raising (``if a.any() and
    #: b.any(): raise``), so that pinning each to the example's would fail batches the model takes
    one_read: bool = False

    def failure(self) -> str:
        """What the stage raises when a batch fails the check: the model's message, where it
        is, and why the pipeline checks it (the example passed)."""
        error = f"{self.error}: " if self.error else ""
        message = self.message or self.code
        return f"{self.where}: {error}{message} ({FAILED_MODEL_CHECK}; the example passed it)"


def value_check(node: fx.Node) -> ValueCheck | None:
    """The check ``node`` (a read of a truth value from a tensor) is part of, or None when the
    read decides real control flow."""
    frames = [
        (line.filename, line.lineno, function)
        for line, function in user_frames(node.meta.get("stack_trace") or "")
    ]
    if not frames:
        return None
    filename, lineno, function = frames[-1]
    path = _statements_at(filename, lineno)
    innermost = path[-1] if path else None
    if not isinstance(innermost, ast.stmt) or _caught(path):
        return None  # a raise the function catches (or suppresses) is control flow
    found = _check_of(innermost, lineno)
    if found is None:
        return None
    error, message, statement, one_read = found
    lineno = statement.lineno
    # a wrapper passing on its own parameter: the message is the argument its caller gives,
    # and the exception the wrapper's (the caller's choice, else the wrapper's default)
    for outer_file, outer_line, outer_function in reversed(frames[:-1]):
        message = _unwrapped(message)
        if not (isinstance(message, ast.Name) or message is None):
            break
        call = _call_of(_statement_at(outer_file, outer_line))
        definition = _function_at(filename, lineno)
        if call is None or definition is None or _name(call.func) != function:
            break
        passed = _parameters(call, definition)
        if isinstance(message, ast.Name):
            if message.id not in passed:
                break  # a local of the wrapper, not what its caller passed
            message = passed[message.id]
        else:  # the check has no message of its own: the wrapper's message parameter
            given = [passed[name] for name in _MESSAGE_KEYWORDS if name in passed]
            if not given and not _is_check_function(call.func):
                break
            message = given[0] if given else _message_of(call)
        errors = [_exception(passed[name]) for name in _ERROR_KEYWORDS if name in passed]
        error = next((e for e in errors if e), "") or _error_of(call) or error
        caller = _statement_at(outer_file, outer_line)
        assert caller is not None  # it holds the call
        filename, function, statement, lineno = outer_file, outer_function, caller, caller.lineno
    line = UserLine(filename, lineno, _first_line(filename, statement))
    return ValueCheck(line.where, line.code, error, _text(_unwrapped(message)), one_read)


# -- the statement at a line ------------------------------------------------------------------
def _module(filename: str) -> ast.Module | None:
    """``filename`` parsed (once for each time it was modified), or None if it cannot be."""
    try:
        return _parsed(filename, os.stat(filename).st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _parsed(filename: str, modified: int) -> ast.Module | None:
    try:
        with open(filename, encoding="utf-8") as handle:
            return ast.parse(handle.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return None


def _statements_at(filename: str, lineno: int) -> list[ast.AST]:
    """The nodes of ``filename`` spanning line ``lineno`` that hold statements, outermost
    first, down to the innermost statement (empty if the file cannot be read)."""
    node: ast.AST | None = _module(filename)
    path: list[ast.AST] = []
    while node is not None:
        node = next(
            (
                child
                for child in ast.iter_child_nodes(node)
                if getattr(child, "lineno", lineno + 1) <= lineno <= getattr(child, "end_lineno", 0)
            ),
            None,
        )
        if isinstance(node, (ast.stmt, ast.excepthandler)):
            path.append(node)
    while path and not isinstance(path[-1], ast.stmt):
        path.pop()
    return path


def _statement_at(filename: str, lineno: int) -> ast.stmt | None:
    """The innermost statement of ``filename`` spanning line ``lineno``."""
    path = _statements_at(filename, lineno)
    return path[-1] if path and isinstance(path[-1], ast.stmt) else None


def _caught(path: list[ast.AST]) -> bool:
    """Whether the innermost statement of ``path`` runs where its own function catches what
    it raises: in the body of a ``try`` with handlers, or a ``with`` block of ``suppress``."""
    functions = [
        i for i, n in enumerate(path) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    within = path[functions[-1] :] if functions else path
    for outer, inner in zip(within, within[1:]):
        if isinstance(outer, (ast.Try, ast.TryStar)) and outer.handlers and inner in outer.body:
            return True
        if isinstance(outer, (ast.With, ast.AsyncWith)) and any(
            isinstance(item.context_expr, ast.Call) and _name(item.context_expr.func) == "suppress"
            for item in outer.items
        ):
            return True
    return False


def _first_line(filename: str, statement: ast.stmt) -> str:
    """The first line of ``statement`` in ``filename``, stripped."""
    return linecache.getline(filename, statement.lineno).strip()


def _spans(expression: ast.expr, lineno: int) -> bool:
    """Whether ``expression`` spans line ``lineno``."""
    return expression.lineno <= lineno <= (expression.end_lineno or expression.lineno)


def _one_read(condition: ast.expr, required: bool) -> bool:
    """Whether ``condition``, which the check needs to be ``required``, combines values so that
    one of several read in it could change without changing the outcome (``a and b`` that must
    be false, ``a or b`` that must be true, a conditional expression)."""
    if isinstance(condition, ast.UnaryOp) and isinstance(condition.op, ast.Not):
        return _one_read(condition.operand, not required)
    if isinstance(condition, ast.BoolOp):
        if isinstance(condition.op, ast.And) != required:
            return True
        return any(_one_read(value, required) for value in condition.values)
    if isinstance(condition, ast.Compare) and len(condition.ops) > 1:
        return not required  # a chain is an and of its comparisons
    return isinstance(condition, ast.IfExp)


# -- which statements are checks --------------------------------------------------------------
def _check_of(
    statement: ast.stmt, lineno: int
) -> tuple[str, ast.expr | None, ast.stmt, bool] | None:
    """``(exception name, message expression, statement raising it, whether it holds for one
    read alone)`` if ``statement`` checks the truth value read at ``lineno``, else None."""
    if isinstance(statement, ast.Assert) and _spans(statement.test, lineno):
        written = ast.Constant(f"assert {ast.unparse(statement.test)}")
        one_read = _one_read(statement.test, True)
        return "AssertionError", statement.msg or written, statement, one_read
    if isinstance(statement, ast.If) and _spans(statement.test, lineno):
        body, orelse = _only_raises(statement.body), _only_raises(statement.orelse)
        if body == orelse:
            return None  # work on both sides (or raising on both): not a check
        side = statement.body if body else statement.orelse
        error, message = _raised(side[-1])
        if message is None:
            when = "" if body else "not "
            message = ast.Constant(f"raised when {when}{ast.unparse(statement.test)}")
        if isinstance(message, ast.Name):  # a message the side computes before raising
            assigned = [
                s.value
                for s in side
                if isinstance(s, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == message.id for t in s.targets)
            ]
            message = assigned[-1] if assigned else message
        return error, message, side[-1], _one_read(statement.test, not body)
    call = _call_of(statement)
    condition = _condition_of(call) if call is not None else None
    if call is not None and condition is not None and _spans(condition, lineno):
        return _error_of(call), _message_of(call), statement, _one_read(condition, True)
    return None


def _condition_of(call: ast.Call) -> ast.expr | None:
    """The condition a check function's call checks, or None if ``call`` is no check."""
    if not _is_check_function(call.func):
        return None
    for keyword in call.keywords:
        if keyword.arg in ("cond", "condition"):
            return keyword.value
    position = 1 if _name(call.func) == "_check_with" else 0
    return call.args[position] if len(call.args) > position else None


def _only_raises(statements: list[ast.stmt]) -> bool:
    """Whether ``statements`` can only end in the ``raise`` ending them (simple statements, a
    message computed or logged, before it)."""
    if not statements or not isinstance(statements[-1], ast.Raise) or statements[-1].exc is None:
        return False
    simple = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)
    return all(isinstance(s, simple) for s in statements[:-1])


def _raised(statement: ast.stmt) -> tuple[str, ast.expr | None]:
    """The exception's name a ``raise`` statement raises, and its message expression."""
    assert isinstance(statement, ast.Raise)  # the side ends in one (_only_raises)
    exc = statement.exc
    if isinstance(exc, ast.Call):
        return _name(exc.func), exc.args[0] if exc.args else None
    return _name(exc) if exc is not None else "", None


def _call_of(statement: ast.stmt | None) -> ast.Call | None:
    """The call a statement is made of (a call whose result is not kept), or None."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        return statement.value
    return None


def _exception(expression: ast.expr) -> str:
    """The name of the exception class ``expression`` names, or "" if it names none."""
    name = _name(expression)
    return name if name.endswith(("Error", "Exception", "Warning", "Interrupt", "Exit")) else ""


def _unwrapped(message: ast.expr | None) -> ast.expr | None:
    """A message given as a function of no arguments (``lambda: msg``) as what it returns."""
    while isinstance(message, ast.Lambda) and not message.args.args:
        message = message.body
    return message


def _name(expression: ast.expr | None) -> str:
    """The last name of a name or an attribute (``torch._check`` -> ``_check``), else ""."""
    if isinstance(expression, ast.Attribute):
        return expression.attr
    if isinstance(expression, ast.Name):
        return expression.id
    return ""


def _is_check_function(function: ast.expr) -> bool:
    """Whether ``function`` is named as a check: torch's, or one with the word "check" in its
    name (``check_inputs``, ``torch_compilable_check``; not ``checkpoint``)."""
    name = _name(function)
    return name in _TORCH_CHECKS or bool(_CHECK_WORD.search(name))


def _error_of(call: ast.Call | None) -> str:
    """The exception a check call raises, where its source says."""
    if call is None:
        return ""
    for keyword in call.keywords:
        if keyword.arg in _ERROR_KEYWORDS:
            return _name(keyword.value)
    name = _name(call.func)
    if name == "_check_with" and call.args:
        return _name(call.args[0])
    return _TORCH_CHECKS.get(name, "")


def _message_of(call: ast.Call) -> ast.expr | None:
    """The message a check function's call passes (after its condition), or None."""
    for keyword in call.keywords:
        if keyword.arg in _MESSAGE_KEYWORDS:
            return keyword.value
    position = 2 if _name(call.func) == "_check_with" else 1
    return call.args[position] if len(call.args) > position else None


def _parameters(
    call: ast.Call, definition: ast.FunctionDef | ast.AsyncFunctionDef
) -> dict[str, ast.expr]:
    """What ``call`` passes for each parameter of the function ``definition`` defines, with the
    defaults of those it leaves out."""
    arguments = definition.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    if names and names[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
        names = names[1:]  # a method: the instance is not among the call's arguments
    defaults = dict(zip(reversed(names), reversed(arguments.defaults)))
    defaults |= {
        a.arg: d for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None
    }
    passed = dict(zip(names, call.args))
    passed |= {k.arg: k.value for k in call.keywords if k.arg is not None}
    return defaults | passed


def _function_at(filename: str, lineno: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function of ``filename`` spanning line ``lineno``."""
    module = _module(filename)
    found = None
    for node in ast.walk(module) if module is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.lineno <= lineno <= (node.end_lineno or 0):
                if found is None or node.lineno > found.lineno:
                    found = node
    return found


# -- the message as the model writes it -------------------------------------------------------
def _text(message: ast.expr | None) -> str:
    """A message expression as text: a string as written, an f-string with its fields as in
    the source, a lambda's result, other expressions as source."""
    if message is None:
        return ""
    if isinstance(message, ast.Lambda):
        return _text(message.body)
    if isinstance(message, ast.Constant):
        return str(message.value)
    if isinstance(message, ast.JoinedStr):
        return "".join(_text(part) for part in message.values)
    if isinstance(message, ast.FormattedValue):  # a field of an f-string, as written
        return ast.unparse(message)
    if isinstance(message, ast.BinOp) and isinstance(message.op, ast.Add):
        return _text(message.left) + _text(message.right)
    return "{" + ast.unparse(message) + "}"
