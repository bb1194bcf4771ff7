"""autopipe/runtime/core/host_memory.py: a CPU process that keeps the memory it frees maps no
fresh pages for the next microbatch's tensors. Each case runs in a process of its own (the
setting is a process's, for good)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

#: a microbatch's worth of tensors of 1-40 MiB (a language model's logits are above the largest
#: mmap threshold glibc allows, 32 MiB), allocated, touched and freed, ten times over:
#: the minor page faults of the last nine rounds, and whether the setting was applied
_ROUNDS = """
import contextlib, json, resource, sys, torch
from autopipe.runtime.core.host_memory import host_memory_retained, retain_freed_host_memory
how = sys.argv[1]
applied = retain_freed_host_memory() if how == "retain" else False
scope = host_memory_retained() if how == "while" else contextlib.nullcontext(False)
def round_():
    kept = [torch.ones(n << 18) for n in (1, 2, 4, 8, 40, 4, 2)]  # MiB of float32
    return sum(float(t[-1]) for t in kept)
with scope as held:
    round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(9):
        round_()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
round_()  # after the scope: glibc's figures back
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    round_()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "after": after, "applied": applied or held}))
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's malloc's",
)


def _rounds(how: str, **env: str) -> dict:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    } | env
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, how],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    ).stdout
    return json.loads(out.splitlines()[-1])


@glibc
def test_freed_tensors_are_reused_without_fresh_pages():
    """Nine rounds of 61 MiB of tensors: glibc's defaults map (and fault in) most of them anew
    each round (one fault per page: 4 KiB, or 2 MiB where transparent huge pages are on);
    kept, they reuse the pages of the round before: for good in a process that keeps them, and
    inside the scope of a library call (a calibration) that does (after it, glibc's figures are
    back, though the blocks it freed stay in the heap for reuse: not asserted)."""
    plain, kept, scoped = _rounds("plain"), _rounds("retain"), _rounds("while")
    assert kept["applied"] and scoped["applied"] and not plain["applied"]
    assert plain["faults"] > 9 * 20  # at least a fault per round's large tensor
    assert kept["faults"] < plain["faults"] / 10 and scoped["faults"] < plain["faults"] / 10
    assert kept["after"] < plain["faults"] / 10  # for good


@glibc
def test_a_users_own_malloc_settings_are_left_alone():
    assert not _rounds("retain", MALLOC_TRIM_THRESHOLD_="131072")["applied"]
    assert not _rounds("retain", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["applied"]
    assert _rounds("retain", GLIBC_TUNABLES="glibc.pthread.rseq=0")["applied"]
