"""``python -m rayspec.tune``: run a Ray Tune sweep; the same command as ``rayspec tune``.

A thin entry point: the command lives in ``rayspec.cli.tune``.
"""

import sys

from rayspec.cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
