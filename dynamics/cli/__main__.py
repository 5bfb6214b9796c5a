"""``python -m dynamics.cli``: the ``dynamics`` command."""

import sys

from dynamics.cli import main

sys.exit(main())
