"""``python -m rayspec.tune``: run a Ray Tune sweep (the command is ``rayspec.cli.tune``)."""

import sys

from rayspec.cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
