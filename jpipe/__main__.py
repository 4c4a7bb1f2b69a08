"""``python -m jpipe``: the :mod:`jpipe.cli` command line."""

import sys

from jpipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
