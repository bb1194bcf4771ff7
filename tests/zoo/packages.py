"""The zoo's packages, each architecture compiled once per test session (``zoo_packages`` in
conftest.py): test_zoo checks them against the models, test_device_consistency runs their stages
on a fake CUDA device."""

from __future__ import annotations

from pathlib import Path

from autopipe.compiler import CompileOptions, compile_spec
from autopipe.spec import load_example

from zoo.survey import save_standalone_inputs, spec, standalone_checks


class Packages:
    """Each architecture compiled once per session (a failed compilation raises again), and the
    standalone check run for every compiled package at once, in one fresh process."""

    def __init__(self, root):
        self.root = root
        self.compiled: dict[str, Path | Exception] = {}
        self.standalone: dict[str, str] = {}

    def get(self, name: str) -> Path:
        if name not in self.compiled:
            out = self.root / name
            try:
                compile_spec(spec(name), out, CompileOptions(stages=2), report=False)
                self.compiled[name] = out
            except Exception as exc:  # noqa: BLE001 - re-raised by every test of this model
                self.compiled[name] = exc
        result = self.compiled[name]
        if isinstance(result, Exception):
            raise result
        return result

    def standalone_result(self, name: str) -> str:
        self.get(name)
        if name not in self.standalone:
            pending = [
                n
                for n, out in self.compiled.items()
                if isinstance(out, Path) and n not in self.standalone
            ]
            cases = [
                (
                    self.compiled[n],
                    save_standalone_inputs(load_example(spec(n)), self.root / f"{n}.pt"),
                )
                for n in pending
            ]
            self.standalone.update(zip(pending, standalone_checks(cases)))
        return self.standalone[name]
