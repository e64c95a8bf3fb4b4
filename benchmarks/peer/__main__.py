"""``python -m benchmarks.peer``: see ``bench.py``."""

from benchmarks.peer.bench import main

main()
