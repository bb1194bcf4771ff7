"""autopipe: compile a PyTorch model into a pipeline-parallel training program."""

__version__ = "0.1.0"
