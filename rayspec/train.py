"""``python -m rayspec.train``: train as configured; the same command as ``rayspec train``.

A thin entry point: the command lives in ``rayspec.cli.train``.
"""

import sys

from rayspec.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
