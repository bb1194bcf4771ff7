"""``python -m autopipe``: the same as the ``autopipe`` command."""

import sys

from .cli import main

sys.exit(main())
