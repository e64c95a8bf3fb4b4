"""``python -m rayspec.study``: run an accuracy study; the same command as ``rayspec study``.

A thin entry point: the command lives in ``rayspec.cli.study``.
"""

import sys

from rayspec.cli.study import main

if __name__ == "__main__":
    sys.exit(main())
