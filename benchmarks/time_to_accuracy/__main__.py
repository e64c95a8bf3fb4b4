"""``python -m benchmarks.time_to_accuracy``: see ``bench.py``."""

from benchmarks.time_to_accuracy.bench import main

main()
