"""``python -m benchmarks.efficiency``: see ``bench.py``."""

from benchmarks.efficiency.bench import main

main()
