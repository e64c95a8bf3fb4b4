"""``python -m rayspec.schedule``: print a schedule; the same command as ``rayspec schedule``.

A thin entry point: the command lives in ``rayspec.cli.schedule``.
"""

import sys

from rayspec.cli.schedule import main

if __name__ == "__main__":
    sys.exit(main())
