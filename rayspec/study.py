"""``python -m rayspec.study``: run an accuracy study (the command is ``rayspec.cli.study``)."""

import sys

from rayspec.cli.study import main

if __name__ == "__main__":
    sys.exit(main())
