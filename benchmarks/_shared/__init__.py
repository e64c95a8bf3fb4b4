"""What several benchmarks share: result files and tables, processes and CPU accounting, the peer model."""
