"""Runtime support of generated pipelines.

This package is copied verbatim into every generated pipeline as its ``runtime/`` subpackage, so
it may import only torch and the standard library: ``support`` builds a stage's parameters under
the original names, ``pipeline`` types the pipeline description, ``schedule`` orders each rank's
actions, ``driver`` is what train.py runs.
"""
