"""``python -m benchmarks.stage_cost``: see ``bench.py``."""

from benchmarks.stage_cost.bench import main

main()
