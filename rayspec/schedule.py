"""``python -m rayspec.schedule``: print a schedule (the command is ``rayspec.cli.schedule``)."""

from rayspec.cli.schedule import main

if __name__ == "__main__":
    main()
