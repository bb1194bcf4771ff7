"""A generated train.py on local gloo ranks, started as torchrun starts them, without torch's
import in every rank.

``torchrun --standalone`` is an agent process: it hosts the run's store, starts one Python
process per rank under the environment of ``LocalElasticAgent`` (ranks, sizes,
``MASTER_ADDR``/``MASTER_PORT`` of its store, the run's id and restart count), each in a session
of its own, and ends the others when one fails. :class:`Ranks` does the same from the test's own
process, with one difference: each rank is forked from a server that has imported torch and its
distributed packages once (:mod:`multiprocessing`'s forkserver), then runs train.py as ``python
train.py ARGS`` would (``__main__``, ``sys.argv``, ``sys.path``, the working directory, the
environment, exit status, output). Every rank is still a process of its own, joined to the
others by a real gloo process group through the store; what it saves is the 3-4 CPU seconds of
importing torch, ``torch._dynamo``, pipelining, FSDP2 and DCP that every rank paid (two thirds
of the suite's time in its ~350 ranks).

What a forked rank cannot have: its own string-hash seed and memory layout (all ranks share the
server's), the seconds of skew that importing torch puts between ranks' starts, the values of
variables read when Python or torch starts (a run given other values than the server's is
refused: :data:`_READ_AT_START`), and the interpreter's own teardown (train.py ends its process
with ``os._exit`` once its process groups are gone, under either launcher). Runs that must start
as a user starts them (a failing run's report, signals, restarts, short timeouts) run the real
torchrun (``conftest.torchrun_failing``, ``conftest.start_torchrun``), and tests/test_ranks.py
checks that sharded stages trained, checkpointed and resumed on forked ranks match the real
torchrun's.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch.distributed as dist

__all__ = ["RANK_SETTINGS", "Ranks", "run_together"]

_HOST = "127.0.0.1"

#: how often a wait looks at the ranks (torchrun's agent looks every 0.1 s, too)
_POLL = 0.1

#: how long the ranks a failure leaves running get to end on SIGTERM before SIGKILL
_GRACE = 30.0

#: what the server imports once for every rank: torch and what train.py's runtime imports of it
_PRELOAD = [
    "torch",
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
]

#: the variables read when Python starts (PYTHONPATH and its sitecustomize, warnings, hashing),
#: when torch loads (OpenMP's and MKL's threads, logging) or when the C library does (malloc):
#: a rank forked from the server has the server's, so a run given other values is refused
_READ_AT_START = ("PYTHON", "OMP_", "MKL_", "MALLOC_", "GLIBC_", "LD_", "TORCH_LOGS", "TORCH_CPP")

#: what every rank of the tests runs with, under either launcher (conftest.torchrun_env): one
#: thread, no warnings
RANK_SETTINGS = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

#: the environment the server starts with: the test process's when this module is imported
#: (before any test changes it), with :data:`RANK_SETTINGS`
_SERVER_ENV = {**os.environ, **RANK_SETTINGS}


class Ranks:
    """``script`` with ``args`` on ``nproc`` local ranks, started at once; :meth:`wait` for
    them. ``env`` is the whole environment of every rank before torchrun's variables; ``cwd`` the
    folder they start in; their output goes to files under ``logs``."""

    def __init__(
        self, script: Path, nproc: int, args: list[str], env: dict[str, str], cwd: Path, logs: Path
    ):
        self.command = [sys.executable, str(script), *args]
        differ = sorted(
            key
            for key in {*env, *_SERVER_ENV}
            if key.startswith(_READ_AT_START) and env.get(key) != _SERVER_ENV.get(key)
        )
        if differ:
            raise ValueError(
                f"{', '.join(differ)}: read when Python or torch starts, and the ranks' server "
                "started with another value (or none); run this under the real torchrun "
                "(conftest.torchrun_command)"
            )
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
        run_id = uuid.uuid4().hex
        logs.mkdir(parents=True)
        self._outputs = [(logs / f"{rank}.out", logs / f"{rank}.err") for rank in range(nproc)]
        context, path = _server()
        self._processes: list[BaseProcess] = []
        self._failed_at: float | None = None
        self._first_failure = 0
        self._result: subprocess.CompletedProcess | None = None
        try:
            for rank, (out, err) in enumerate(self._outputs):
                rank_env = _worker_env(env, rank, nproc, self._store.port, run_id)
                started = (str(script), list(args), rank_env, str(cwd), path, str(out), str(err))
                process = context.Process(target=run_script, args=started, name=f"rank {rank}")
                process.start()
                self._processes.append(process)
        except BaseException:
            self.close()
            raise

    def poll(self) -> subprocess.CompletedProcess | None:
        """The ranks' result once all have ended, else None: the exit status of the first rank
        seen to fail (the lowest of those seen at once; the others are then sent SIGTERM, as
        torchrun does, and SIGKILL after :data:`_GRACE` seconds), else 0; stdout and stderr each
        as every rank's in turn, rank 0 first."""
        if self._result is not None:
            return self._result
        codes = [process.exitcode for process in self._processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed and self._failed_at is None:
            self._failed_at = time.monotonic()
            self._first_failure = failed[0]
            for process in self._processes:
                _signal(process, signal.SIGTERM)
        if self._failed_at is not None and time.monotonic() > self._failed_at + _GRACE:
            self.close()
            codes = [process.exitcode for process in self._processes]
        if any(code is None for code in codes):
            return None
        code = self._first_failure if self._failed_at is not None else 0
        stdout = "".join(out.read_text() for out, _ in self._outputs)
        stderr = "".join(err.read_text() for _, err in self._outputs)
        self._result = subprocess.CompletedProcess(self.command, code, stdout, stderr)
        return self._result

    def wait(self, deadline: float) -> subprocess.CompletedProcess:
        """:meth:`poll` until the ranks end; they are killed and ``TimeoutError`` raised when
        ``deadline`` (``time.monotonic()``) passes first."""
        while (result := self.poll()) is None:
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"{' '.join(self.command)} ran past its timeout")
            time.sleep(_POLL)
        return result

    def close(self) -> None:
        """Kill the ranks that still run (and what they started), and wait for them."""
        for process in self._processes:
            _signal(process, signal.SIGKILL)
            process.join()


def run_together(
    runs: list[tuple[Path, int, list[str]]], env: dict[str, str], cwd: Path, timeout: float
) -> list[subprocess.CompletedProcess]:
    """Each ``(script, nproc, args)`` on ranks of its own, all started at once; their results in
    order, once all have ended (each killed at ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        started: list[Ranks] = []
        try:
            for index, (script, nproc, args) in enumerate(runs):
                started.append(Ranks(script, nproc, args, env, cwd, Path(logs) / str(index)))
            return [ranks.wait(deadline) for ranks in started]
        finally:
            for ranks in started:
                ranks.close()


def run_script(
    script: str, args: list[str], env: dict[str, str], cwd: str, path: list[str], out: str, err: str
) -> None:
    """In a rank forked from the server: ``python script *args`` as the interpreter runs it, in
    ``cwd`` under ``env`` alone, with the script's folder and then ``path`` to import from, its
    output into the files ``out`` and ``err``, in a session of its own (as torchrun starts its
    workers: a signal to its group reaches what it starts); its exit status is the process's."""
    os.setsid()
    for fd, name in ((1, out), (2, err)):
        file = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path[:] = [str(Path(script).resolve().parent), *path]
    warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore, as the ranks ran under torchrun
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit, which a forked child skips


def _server() -> tuple[ForkServerContext, list[str]]:
    """The forkserver context, its server started (once per process) with torch imported,
    under :data:`_SERVER_ENV`; and the import path of a plain interpreter under it, after which
    a rank's script's folder goes first."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SERVER_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(before)
    return context, list(_plain_path())


@functools.cache
def _plain_path() -> tuple[str, ...]:
    """``sys.path`` of a plain interpreter under :data:`_SERVER_ENV` (PYTHONPATH included), less
    its first entry (the script's folder): the test's own has pytest's additions."""
    printed = subprocess.run(
        [sys.executable, "-c", "import sys; print('\\n'.join(sys.path[1:]))"],
        env=_SERVER_ENV,
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    ).stdout
    return tuple(line for line in printed.splitlines() if line)


def _signal(process: BaseProcess, signum: int) -> None:
    """Send ``signum`` to the session of a rank that still runs (the rank and its children), or
    to the rank alone before it has made its session."""
    if process.exitcode is None and process.pid is not None:
        for send in (os.killpg, os.kill):
            try:
                send(process.pid, signum)
                return
            except ProcessLookupError:  # no such group yet (or the rank ended meanwhile)
                pass


def _worker_env(env: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict:
    """What torchrun's ``LocalElasticAgent`` sets for local ``rank`` of one node, its store
    hosted at ``port`` (``TORCHELASTIC_USE_AGENT_STORE``), first attempt."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": _HOST,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
