"""``python -m benchmarks.hops``: see ``bench.py``."""

from benchmarks.hops.bench import main

main()
