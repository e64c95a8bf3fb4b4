"""``python -m benchmarks.recovery``: see ``bench.py``."""

from benchmarks.recovery.bench import main

main()
