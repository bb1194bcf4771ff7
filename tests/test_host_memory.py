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
import json, resource, sys, torch
from autopipe.runtime.core.host_memory import retain_freed_host_memory
applied = retain_freed_host_memory() if sys.argv[1] == "retain" else False
def round_():
    kept = [torch.ones(n << 18) for n in (1, 2, 4, 8, 40, 4, 2)]  # MiB of float32
    return sum(float(t[-1]) for t in kept)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    round_()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "applied": applied}))
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's malloc's",
)


def _rounds(how: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
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
    """Nine rounds of 61 MiB of tensors: glibc's defaults map (and fault in) most of them
    anew each round, 1 fault per 4 KiB page; kept, they reuse the pages of the round before."""
    plain, kept = _rounds("plain"), _rounds("retain")
    assert kept["applied"] and not plain["applied"]
    pages = 9 * (61 << 20) // 4096
    assert plain["faults"] > pages / 4  # most of the rounds' pages faulted in again
    assert kept["faults"] < plain["faults"] / 10


@glibc
def test_a_users_own_malloc_settings_are_left_alone():
    assert not _rounds("retain", MALLOC_TRIM_THRESHOLD_="131072")["applied"]
