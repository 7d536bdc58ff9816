"""`python -m spindle ...`: the same as the `spindle` command."""

import sys

from spindle.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
