"""Training throughput (samples/s) of every method, data parallelism included."""
