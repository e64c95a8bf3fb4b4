"""``python -m rayspec.train``: train as configured (the command is ``rayspec.cli.train``)."""

from rayspec.cli.train import main

if __name__ == "__main__":
    main()
