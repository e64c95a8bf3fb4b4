"""``python -m benchmarks.studies``: see ``bench.py``."""

from benchmarks.studies.bench import main

main()
