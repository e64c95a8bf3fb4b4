"""``python -m benchmarks.probe``: see ``bench.py``."""

from benchmarks.probe.bench import main

main()
