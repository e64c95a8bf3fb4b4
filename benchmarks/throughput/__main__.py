"""``python -m benchmarks.throughput``: see ``bench.py``."""

from benchmarks.throughput.bench import main

main()
