"""``python -m benchmarks.partition``: see ``bench.py``."""

from benchmarks.partition.bench import main

main()
