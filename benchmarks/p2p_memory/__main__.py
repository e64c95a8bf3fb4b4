"""``python -m benchmarks.p2p_memory``: see ``bench.py``."""

from benchmarks.p2p_memory.bench import main

main()
