"""``python -m benchmarks.memory``: see ``bench.py``."""

from benchmarks.memory.bench import main

main()
