"""``python -m benchmarks.communication``: see ``bench.py``."""

from benchmarks.communication.bench import main

main()
