"""``python -m benchmarks.overhead``: see ``bench.py``."""

from benchmarks.overhead.bench import main

main()
