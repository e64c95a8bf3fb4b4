"""rayspec's benchmarks: one folder per question, each with its entry (``bench.py``), a README and its results.

``python -m benchmarks list`` names them; ``python -m benchmarks run NAME [--quick] [ARGS...]`` runs one
(the same as ``python -m benchmarks.NAME``). Helpers that several share live in ``benchmarks._shared``.
"""
