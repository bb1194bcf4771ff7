"""The structure digest checkpoints are keyed by (``fingerprint``), as literals of committed
gallery packages: a change of the algorithm, or of a committed package's structure, fails here
(checkpoints written before it would no longer resume)."""

from __future__ import annotations

import json

import pytest

from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.train_state import fingerprint

from conftest import ROOT


@pytest.mark.parametrize(
    "package, digest",
    [("gpt2_4", "4a78547729d881f3"), ("bert_base_2", "b56a1fa7f77f03f9")],
)
def test_fingerprint_of_a_committed_package(package, digest):
    data = json.loads((ROOT / "generated" / package / "pipeline.json").read_text())
    assert fingerprint(Pipeline.from_json(data)) == digest


def test_fingerprint_reads_only_the_structure():
    """Recomputation does not change it (a resumed run may recompute other stages); where a
    stage runs does."""
    data = json.loads((ROOT / "generated" / "gpt2_4" / "pipeline.json").read_text())
    digest = fingerprint(Pipeline.from_json(data))
    recomputing = json.loads(json.dumps(data))
    recomputing["stages"][0]["recompute"] = not data["stages"][0]["recompute"]
    assert fingerprint(Pipeline.from_json(recomputing)) == digest
    moved = json.loads(json.dumps(data))
    moved["stages"][0]["device"], moved["stages"][1]["device"] = 1, 0
    assert fingerprint(Pipeline.from_json(moved)) != digest
