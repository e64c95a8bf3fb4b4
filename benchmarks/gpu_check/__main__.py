"""``python -m benchmarks.gpu_check``: see ``bench.py``."""

from benchmarks.gpu_check.bench import main

raise SystemExit(main())
