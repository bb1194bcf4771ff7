"""The user's source line an error or a generated comment names, found and printed one way.

A line is the innermost frame in user code: not torch, not autopipe, not the standard library.
Its file is shown as generated code may name it, with no absolute path: within an installed
package from the package on, else relative to the working directory, else by its name alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.fx.proxy
from torch import fx

__all__ = [
    "UserLine",
    "at_node",
    "every_user_frame_recorded",
    "in_stack_trace",
    "in_traceback",
    "is_user_file",
    "on_stack",
    "short_path",
    "user_frames",
]

#: Directories of code that is not the user's: torch and autopipe, ...
_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
#: ... and the standard library, but for the packages installed within it
_STDLIB_DIR = os.path.dirname(os.path.abspath(inspect.__file__)) + os.sep

#: One frame of a formatted stack trace (``node.meta["stack_trace"]``) and its source line.
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+).*\n(?P<code>.*)'
)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` holds user code (not torch, autopipe or the standard library; an
    installed package is the user's, though Python without a virtual environment installs
    packages within the standard library's folder)."""
    if filename.startswith("<"):
        return False
    # asked for every frame of every traced node's stack: once per file
    return _is_user_path(filename if os.path.isabs(filename) else os.path.abspath(filename))


@functools.lru_cache(maxsize=4096)
def _is_user_path(absolute: str) -> bool:
    path = os.path.normpath(absolute)
    if path.startswith(_LIBRARY_DIRS):
        return False
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return installed or not path.startswith(_STDLIB_DIR)


def short_path(filename: str) -> str:
    """A source file as generated code may name it (no absolute paths in generated files):
    within an installed package from the package on, else relative to the working directory,
    else its name."""
    path = os.path.abspath(filename)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.path.basename(path)


@dataclass(frozen=True)
class UserLine:
    """A line of user code: its file (as recorded), line number and source text (stripped)."""

    filename: str
    lineno: int
    code: str

    @property
    def where(self) -> str:
        """``FILE:LINE``, the file shown by :func:`short_path`."""
        return f"{short_path(self.filename)}:{self.lineno}"

    @property
    def code_block(self) -> str:
        """The source line indented on a line of its own (``"\\n    code"``), or ``""``."""
        return f"\n    {self.code}" if self.code else ""


def _innermost(frames: Iterable[traceback.FrameSummary]) -> UserLine | None:
    for frame in reversed(list(frames)):
        if is_user_file(frame.filename):
            return UserLine(frame.filename, frame.lineno or 0, (frame.line or "").strip())
    return None


def in_traceback(exc: BaseException) -> UserLine | None:
    """The innermost line of user code in the traceback of ``exc``."""
    return _innermost(traceback.extract_tb(exc.__traceback__))


def on_stack() -> UserLine | None:
    """The innermost line of user code on the current call stack."""
    return _innermost(traceback.extract_stack())


def user_frames(text: str) -> list[tuple[UserLine, str]]:
    """The frames of user code in a formatted stack trace (``torch.fx`` records one per node as
    ``node.meta["stack_trace"]``), outermost first: each line and its function's name."""
    return [
        (UserLine(m["file"], int(m["line"]), m["code"].strip()), m["function"])
        for m in _FRAME.finditer(text)
        if is_user_file(m["file"])
    ]


def in_stack_trace(text: str) -> UserLine | None:
    """The innermost line of user code in a formatted stack trace."""
    frames = user_frames(text)
    return frames[-1][0] if frames else None


def at_node(node: fx.Node) -> tuple[str, str]:
    """Where in the user's code ``node`` was traced: ``("file.py:12", "\\n    code")``."""
    line = in_stack_trace(node.meta.get("stack_trace") or "")
    return (line.where, line.code_block) if line else ("the model's forward", "")


class _UserFrames(set):
    """Stands for torch's set of ``(file, function)`` frames a traced node's stack trace keeps
    beside the ``forward`` methods' (what torch registers in it meanwhile included): every
    frame of user code as well."""

    def __init__(self, frames: set[object]) -> None:
        super().__init__(frames)
        #: whether each frame asked about is user code: torch asks for every frame of every node
        self.answers: dict[object, bool] = {}

    def __contains__(self, frame: object) -> bool:
        if super().__contains__(frame):
            return True
        answer = self.answers.get(frame)
        if answer is None:
            answer = isinstance(frame, tuple) and bool(frame) and is_user_file(str(frame[0]))
            self.answers[frame] = answer
        return answer


@contextlib.contextmanager
def every_user_frame_recorded() -> Iterator[None]:
    """While the block runs, the stack traces ``torch.export`` records for nodes keep every
    frame of user code, not only ``forward`` methods: the line a helper function (a check in
    ``get_placeholder_mask``) runs is the node's innermost user line. torch keeps those frames
    in ``torch.fx.proxy._STACK_TRACE_ANCHORS`` (functions registered as user code); without
    it, stack traces are torch's own."""
    anchors = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", None)
    if not isinstance(anchors, set):
        yield
        return
    standing = _UserFrames(anchors)
    torch.fx.proxy._STACK_TRACE_ANCHORS = standing
    try:
        yield
    finally:
        torch.fx.proxy._STACK_TRACE_ANCHORS = anchors
        anchors.update(standing)  # what torch registered meanwhile stays
