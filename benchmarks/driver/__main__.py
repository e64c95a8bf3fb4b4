"""``python -m benchmarks.driver``: see ``bench.py``."""

from benchmarks.driver.bench import main

main()
