"""Train GPT2LMHeadModel with the 2-stage pipeline in this directory.

    torchrun --nproc-per-node=2 train.py --steps 100

Each rank runs its stages with torch.distributed.pipelining (NCCL on CUDA, gloo on CPU).
`python train.py --help` lists the options. Needs only torch.
"""

import importlib.util
import sys
from pathlib import Path


def load_pipeline_package(name: str = "autopipe_pipeline"):
    """Import this directory as a package, whatever it is called and wherever it lies."""
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        name, here / "__init__.py", submodule_search_locations=[str(here)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


if __name__ == "__main__":
    pipeline = load_pipeline_package()
    from autopipe_pipeline.runtime.driver import main

    sys.exit(main(pipeline, sys.argv[1:]))
