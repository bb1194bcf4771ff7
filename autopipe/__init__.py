"""autopipe: compile a PyTorch model into a pipeline-parallel training program.

    import autopipe
    autopipe.pipe_model(model, (input_ids,), {"labels": labels}, stages=4, out="generated/gpt2_4")

writes a standalone package (stage modules, pipeline description, ``train.py``) to run with
``torchrun --nproc-per-node=4 generated/gpt2_4/train.py``.
"""

from .artifacts import AUTOPIPE_VERSION as __version__  # noqa: E402
from .compiler import CompileOptions, compile_example, compile_spec, pipe_model  # noqa: E402
from .errors import AutopipeError  # noqa: E402
from .tracing.meta import empty_weights  # noqa: E402
from .verify import load_pipeline, verify  # noqa: E402

__all__ = [
    "pipe_model",
    "empty_weights",
    "compile_spec",
    "compile_example",
    "CompileOptions",
    "load_pipeline",
    "verify",
    "AutopipeError",
    "__version__",
]
