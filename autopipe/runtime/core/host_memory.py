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
to 119,000 page faults a step -> 1,200, its resident peak 5 % higher, its step 5-12 % shorter). The calibration and the measured profile run under it too, so that
a plan's times are those of the run. Copied into every generated pipeline; needs only the
standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["retain_freed_host_memory"]

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: free memory at the top of the heap kept rather than trimmed (the most mallopt takes: an int)
_TRIM_THRESHOLD = 2**31 - 1
#: glibc's own settings: a user who set one has chosen and is left alone
_USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)

_applied: bool | None = None


def retain_freed_host_memory() -> bool:
    """Have this process's ``malloc`` take every block from its heap and keep freed memory
    for reuse (see the module's text); True where it now does. Does nothing (False) off Linux, under another C
    library than glibc, or where the environment sets glibc's malloc settings itself. Once per
    process: the setting is the process's."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if platform.system() != "Linux" or any(name in os.environ for name in _USER_SETTINGS):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # no block mapped on its own (a heap that cannot grow still falls back to mapping)
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
