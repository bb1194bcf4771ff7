"""``python -m autopipe``: the same as the ``autopipe`` command."""

from .cli import run

run()
