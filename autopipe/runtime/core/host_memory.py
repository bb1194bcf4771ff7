"""Host memory that stays with the process between microbatches.

torch's CPU tensors come from the C library's ``malloc``. glibc serves every request above its
mmap threshold (128 KiB, raised on the fly to the largest block freed, at most 32 MiB) with fresh
pages from the kernel and hands them back on ``free``; the top of its heap is trimmed the same
way. A training step frees each microbatch's activations after its backward and allocates the
next microbatch's anew, so every large tensor of every microbatch faults its pages in again and
has the kernel zero them: about 0.3 ms per MiB on one core, a tenth of a GPT-2 stage's backward
(its logits and their gradients, 4 MiB each per microbatch, cost 1.5 ms where the kernels take
0.5). A GPU run never pays this: torch's CUDA caching allocator keeps what it frees.

:func:`retain_freed_host_memory` makes glibc do the same for the host: every block comes from its
heap (none is mapped on its own, however large: a language model's logits, 32 MiB at 1024 tokens
and a vocabulary of 8192, are above the largest threshold glibc allows, 32 MiB) and freed memory
is kept for the next microbatch rather than trimmed, so the process holds its peak, which it
reaches every step anyway (the parity ladder's GPT-2, two microbatches of 1,024 tokens: 72,000
to 119,000 page faults a step -> 1,200, its resident peak 5 % higher, its step 5-12 % shorter).
The calibration and the measured profile run under it too, so that a plan's times are those of
the run, each only while it measures (:func:`host_memory_retained`: a library call leaves its
caller's allocator with glibc's default figures, though its mmap threshold no longer moves).
The setting holds for the main thread's heap, where torch allocates on a CPU (the autograd
engine runs a CPU backward on the calling thread); other threads' heaps still map blocks over
64 MiB and hand back heaps they empty. Copied into every generated pipeline; needs only the
standard library.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["host_memory_retained", "retain_freed_host_memory"]

#: glibc's mallopt parameters (malloc.h) and their defaults
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
_DEFAULT_MMAP_MAX = 65536
#: free memory at the top of the heap kept rather than trimmed (the most mallopt takes: an int)
_TRIM_THRESHOLD = 2**31 - 1
#: glibc's own malloc settings: a user who set one has chosen and is left alone
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = "glibc.malloc."

_retained = False  # set for good by retain_freed_host_memory


def retain_freed_host_memory() -> bool:
    """Have this process's ``malloc`` take every block from its heap and keep freed memory
    for reuse, for the rest of the process (see the module's text): train.py's ranks on a CPU.
    True where it now does; False (nothing done) off Linux, under another C library than
    glibc, or where the environment sets glibc's malloc settings itself."""
    global _retained
    if not _retained:
        _retained = _set(0, _TRIM_THRESHOLD)
    return _retained


@contextmanager
def host_memory_retained() -> Iterator[bool]:
    """:func:`retain_freed_host_memory` while the block runs (a calibration, a measured
    profile), glibc's default figures back after it unless the process keeps the setting for
    good; yields whether it holds."""
    if _retained:
        yield True
        return
    held = _set(0, _TRIM_THRESHOLD)
    try:
        yield held
    finally:
        if held and not _retained:
            _set(_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD)


def _set(mmap_max: int, trim_threshold: int) -> bool:
    """glibc's ``M_MMAP_MAX`` and ``M_TRIM_THRESHOLD`` (with no block mapped on its own, a heap
    that cannot grow still falls back to mapping); False where they are not this module's to
    set."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, mmap_max)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None off Linux, under another C library, or where the
    environment sets glibc's malloc settings (``MALLOC_*_``, or ``glibc.malloc.`` tunables)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ for name in _USER_SETTINGS):
        return None
    if _USER_TUNABLES in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
