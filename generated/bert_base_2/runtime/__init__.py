"""Runtime support of generated pipelines.

This package is copied verbatim into every generated pipeline as its ``runtime/`` subpackage, so
it may import only torch and the standard library. It has two roles:

* ``core/``, shared with the compiler (which imports nothing else of the runtime): the pipeline
  contract (``core.pipeline``), the schedule catalogue and action orders (``core.schedules``),
  size formulas (``core.shapes``), the sizes of a batch's dynamic dimensions, the global ranks'
  places on the device mesh (``core.mesh``), live-tensor memory counting and the run's errors;
* the executor, what train.py runs: ``driver`` (the training loop), ``options`` (train.py's
  command line), ``data`` (batches), ``parallel`` (process groups, data parallelism),
  ``checkpoint`` and ``train_state`` (weights and training checkpoints), ``guards`` (output
  checks, run lock, non-finite steps), ``metrics`` (logs), ``dry_run`` (``--dry-run``: the
  job's ranks played in one process on fake tensors) and ``support``, which the generated stage
  modules import to build their parameters under the original names.
"""
