"""The version of autopipe (the package and the artefacts it writes say it)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
